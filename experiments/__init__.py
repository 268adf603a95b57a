"""Reproduce the paper's figures from declarative specs: ``rwinterp reproduce FIG [FIG ...] | all --out DIR``.

Layout
------
* :mod:`experiments.spec`: the data types of a figure (FigureSpec, RunSpec, Record, Panel, Claim,
  Check) and the sources that read run results (History, Final, Snapshot, Computed).
* :mod:`experiments.quantities`: what a run can record at chosen steps (V, attention,
  averaged_token, v_column_spread, attention_spread, sqrt_distance, position_logits); add more
  with ``@quantity``.
* :mod:`experiments.runner`: discovers the specs, trains each distinct run once (shared between
  figures), draws, checks, writes ``figNN.png``, ``results.json``, ``runs.json``, ``REPRODUCTION.md``.
* :mod:`experiments.plots`, :mod:`experiments.report`: drawing (seaborn) and the report.
* :mod:`experiments.executors`: where jobs run (this machine's processes, or Ray), for the runner and
  for :mod:`experiments.sweep` (``rwinterp sweep``: a grid of train jobs into one table, ``docs/sweeps.md``).
* :mod:`experiments.specs`: one module per figure (``fig02.py`` ... ``fig13.py``) or extra study
  (``fragility``, ``theorem31``, ``lockin``, ``probes``), each with ``SPEC``; modules starting with
  ``_`` hold shared builders (``_walk``: Figs 4/5/8/9, ``_qa``: Figs 7/10, ``_random_init``: 6/11-13).

Writing a spec
--------------
Create ``experiments/specs/figNN.py`` defining ``SPEC = FigureSpec(...)``; the runner finds it by
module. A spec names its runs, its panels and its claims::

    from experiments.spec import (Claim, FigureSpec, Final, History, Panel, Record, RunSpec,
                                  Snapshot, accuracy_near, at_least)

    run = RunSpec(
        "p05",
        task={"kind": "circle", "K": 6, "p": 0.5, "N": 97},
        model={"pos_dim": 1000, "init": "gaussian", "init_sigma": 0.01, "normalize_tokens": True},
        train={"lr": 0.01, "steps": 1000},
        record=Record(quantities=("V", "attention", "averaged_token"), at=(100, 400, 700, 1000)),
    )
    SPEC = FigureSpec(
        id="11", title="random initialisation, p = 0.5",
        caption="V recovers Pi^T and the parent position takes most of the attention.",
        runs=[run],
        panels=[Panel("line", "(a) test accuracy", series={"test": History("p05", "test_accuracy")},
                      xlabel="step", ylabel="accuracy"),
                Panel("heatmap", "(b) V at step 400", data=Snapshot("p05", "V", 400))],
        claims=[Claim("accuracy reaches max(p, 1-p)", Final("p05", "test_accuracy"),
                      accuracy_near("p05", 0.5), reduced=False,
                      note="what was tried if it fails")],
        reduced={"model": {"pos_dim": 200}, "train": {"steps": 20, "n_train": 200, "n_test": 200},
                 "record": {"at": (5, 10, 15, 20)}},
    )

Rules: one run per distinct training configuration (the runner shares identical ones between
figures); never widen a tolerance to make a claim pass: a claim that does not hold keeps a
``note`` saying why and what was tried; every spec must run in reduced mode within a few seconds
(``tests/test_experiments.py`` runs them all).
"""
