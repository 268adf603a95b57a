"""``python -m rwinterp``: the command line."""

from rwinterp.cli import main

raise SystemExit(main())
