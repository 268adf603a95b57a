"""One module per figure of the paper (``figNN.py``) or extra study, each defining ``SPEC``.

The runner (:func:`experiments.runner.discover`) imports every module here and collects its
``SPEC`` (a :class:`experiments.spec.FigureSpec`). See :mod:`experiments` for how to write one.
"""
