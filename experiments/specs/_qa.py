"""Shared builder for the QA figures (7: attention only; 10: with the FC+ReLU layer, m = 19).

Each figure trains both tasks from N(0, 0.01^2) initialisation with unit-normalised x~ in the
attention (``docs/model.md`` section 6: only then do the QA results come out as in the paper). Panels
per task: test accuracy by step, and the mean attention over the test sentences by word. ``readings``
adds runs under other readings of the paper's setting, with their own claims, so that a claim that
does not hold under the stated setting is shown next to what does reproduce it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from experiments.spec import (Claim, Computed, FigureSpec, Final, History, Panel, Record, Results, RunSpec,
                              accuracy_near, at_least, at_most, is_true, near)
from rwinterp.metrics import predict
from rwinterp.qa import FRUITS, VOCAB, QAMajority, QAOrder, QATask

QA_MODEL = {"pos_dim": 1000, "init": "gaussian", "init_sigma": 0.01, "normalize_tokens": True}
REDUCED = {"model": {"pos_dim": 200}}
TASKS: dict[str, type[QATask]] = {"task1": QAMajority, "task2": QAOrder}
#: Seeds (initialisation and sentences) of task 1 under a figure's stated setting; seed 0 is the
#: figure's main run, ``task1``.
SEEDS = tuple(range(10))


def seed_run(seed: int, prefix: str = "") -> str:
    return f"{prefix}task1" if seed == 0 else f"{prefix}task1_seed{seed}"


def task1_run(name: str, model: dict, train: dict, label: str) -> RunSpec:
    """A task 1 run that keeps only its history (5 steps in reduced mode)."""
    return RunSpec(name, {"kind": QAMajority.kind}, model, train, Record(()), {"train": {"steps": 5}}, label=label)


def seed_runs(model: dict, train: dict, prefix: str = "", seeds: Sequence[int] = SEEDS[1:]) -> list[RunSpec]:
    """Task 1 under ``model``/``train`` with ``seeds`` (by default those of :data:`SEEDS` other than 0,
    whose run is the figure's main one), named by :func:`seed_run` with ``prefix``."""
    return [task1_run(seed_run(s, prefix), {**model, "seed": s}, {**train, "seed": s}, f"seed {s}") for s in seeds]


#: The runs of :data:`SEEDS`.
SEED_RUNS = tuple(seed_run(s) for s in SEEDS)


def ending_at_one(results: Results, runs: Sequence[str]) -> int:
    """How many of ``runs`` end at 100% test accuracy."""
    return sum(bool(results[r].final["test_accuracy"] == 1.0) for r in runs)


def passing_through_one(results: Results, runs: Sequence[str]) -> int:
    """How many of ``runs`` reach 100% test accuracy at some step but do not end there."""
    accs = (results[r].series("test_accuracy")[1] for r in runs)
    return sum(bool(a.max() == 1.0 and a[-1] < 1.0) for a in accs)


def answer_share(results: Results, run: str) -> float:
    """The share of ``run``'s test sentences that its model answers with a fruit (any other word is wrong)."""
    r = results[run]
    with torch.no_grad():
        answers = predict(r.model(r.test.tokens))
    return float(torch.isin(answers, torch.tensor([VOCAB.index(f) for f in FRUITS])).double().mean())


def seed_panel(title: str, prefix: str = "") -> Panel:
    """Task 1's test accuracy by step, one curve per seed (the runs of :func:`seed_run` with ``prefix``)."""
    return Panel("line", title, series={f"seed {s}": History(seed_run(s, prefix), "test_accuracy") for s in SEEDS},
                 xlabel="step", ylabel="accuracy", ylim=(-0.02, 1.05), options={"legend_columns": 2})


def word_labels(task: type[QATask]) -> list[str]:
    return [w if w is not None else "FRUIT" for w in task.TEMPLATE] + ["?"]


def qa_runs(prefix: str, model: dict, train: dict, reduced_steps: int,
            task1_every_step: Sequence[str] = ()) -> list[RunSpec]:
    """Both tasks' runs; ``task1_every_step``: quantities task 1's run records at every step."""
    def record(name: str) -> Record:
        if name == "task1" and task1_every_step:
            return Record(("attention", *task1_every_step), at=None)
        return Record(("attention",))

    return [RunSpec(f"{prefix}{name}", {"kind": cls.kind}, dict(model), dict(train), record(name),
                    {"train": {"steps": reduced_steps}}) for name, cls in TASKS.items()]


def same_bag_of_words(task: QATask) -> bool:
    """Do all sentences of the task contain the same words with the same counts?"""
    import torch

    pop = task.population()
    counts = torch.stack([torch.bincount(row, minlength=task.d_vocab) for row in pop.tokens])
    return bool((counts == counts[0]).all())


def bag_decides(task: QATask) -> bool:
    """Does the bag of words (token counts) determine the label?"""
    pop = task.population()
    seen: dict[tuple, int] = {}
    for row, label in zip(pop.tokens.tolist(), pop.labels.tolist()):
        key = tuple(sorted(row))
        if seen.setdefault(key, label) != label:
            return False
    return True


def qa_claims(prefix: str, setting: str, note1: str = "", note2: str = "", reduced: bool = True,
              reproduces: bool = True) -> list[Claim]:
    if not reproduces:
        return [Claim(f"task 1 is NOT learned under this reading (docs/model.md section 6) [{setting}]",
                      Final(f"{prefix}task1", "test_accuracy"), at_most(0.9), note=note1),
                Claim(f"task 2 IS learned under this reading: the two tasks come out reversed "
                      f"(docs/model.md section 6) [{setting}]",
                      Final(f"{prefix}task2", "test_accuracy"), at_least(0.9), note=note2,
                      why=lambda r: "Here neither task is learned: " + "; ".join(
                          f"task {t[-1]} ends at {r[prefix + t].final['test_accuracy']:.3f} test accuracy, "
                          f"answering {answer_share(r, prefix + t):.0%} of the test sentences with a fruit"
                          for t in TASKS) + ".")]
    return [
        Claim(f"task 1 (majority) reaches 100% test accuracy within 100 steps (measured at step 100) [{setting}]",
              Final(f"{prefix}task1", "test_accuracy"), near(1.0, 0.0), reduced=reduced, note=note1),
        Claim(f"task 2 (order) stays near 50% [{setting}]",
              Final(f"{prefix}task2", "test_accuracy"), accuracy_near(f"{prefix}task2", 0.5), reduced=reduced,
              note=("tolerance: 3 standard errors of the test-set accuracy. " + note2).strip()),
    ]


def qa_figure(fig_id: str, title: str, model: dict, train: dict, claims_note: str = "",
              readings: Optional[list[tuple[str, str, dict, dict, str, bool]]] = None,
              extra_claims: Sequence[Claim] = (), extra_panels: Sequence[Panel] = (),
              extra_runs: Sequence[RunSpec] = (), task1_every_step: Sequence[str] = (),
              caption_note: str = "") -> FigureSpec:
    """``readings``: (prefix, description, model, train, note, reproduces) of alternative settings to
    run too; ``reproduces`` says whether the reading is expected to give the paper's picture (if not,
    the claim checked is that task 1 is not learned). ``extra_claims``, ``extra_panels`` and the
    ``extra_runs`` they read are appended (diagnostics); ``task1_every_step`` names quantities every
    task 1 run records at each step; ``caption_note`` is added to the caption."""
    runs = qa_runs("", model, train, 30, task1_every_step)
    claims = qa_claims("", "the paper's setting", claims_note, reduced=not readings)
    panels = []
    for i, (name, cls) in enumerate(TASKS.items()):
        series = {"paper's setting": History(name, "test_accuracy")}
        for prefix, desc, *_ in readings or []:
            series[desc] = History(f"{prefix}{name}", "test_accuracy")
        panels += [
            Panel("line", f"({'ac'[i]}) task {name[-1]}: test accuracy", series=series, xlabel="step",
                  ylabel="accuracy", ylim=(-0.02, 1.05), ref={"chance 1/2": 0.5}, options={"dashes": True}),
            Panel("bar", f"({'bd'[i]}) task {name[-1]}: mean attention by word", data=Final(name, "attention"),
                  xlabel="", ylabel="attention", options={"xticklabels": word_labels(cls), "rotation": 90}),
        ]
    for prefix, desc, r_model, r_train, note, reproduces in readings or []:
        runs += qa_runs(prefix, r_model, r_train, 100, task1_every_step)
        claims += qa_claims(prefix, desc, note, note, reduced=False, reproduces=reproduces)
    claims += [
        Claim("task 2's two sentences have the same bag of words (so near-uniform attention cannot separate them)",
              Computed(lambda r: same_bag_of_words(QAOrder())), is_true(), reduced=True),
        Claim("task 1's bag of words determines its answer (so near-uniform attention suffices)",
              Computed(lambda r: bag_decides(QAMajority())), is_true(), reduced=True),
        *extra_claims,
    ]
    panels += list(extra_panels)
    runs += list(extra_runs)
    cols = min(len(panels), 4)
    return FigureSpec(
        id=fig_id, title=title,
        caption=("The paper: task 1 (which fruit is the majority of five) is learned to 100%, its answer being "
                 "decided by the bag of words; task 2 (I prefer an A to an B) stays at 50%: both of its sentences "
                 "have the same bag of words, so a model that averages tokens cannot tell them apart, like the "
                 "deterministic walk. Bars: mean attention of the query slot on each word under the paper's "
                 "setting (FRUIT = a fruit slot, ? = the query slot itself)."
                 + (" " + caption_note if caption_note else "")),
        runs=runs, panels=panels, claims=claims, layout=(-(-len(panels) // cols), cols), reduced=REDUCED,
        panel_size=(4.2, 3.4),
    )
