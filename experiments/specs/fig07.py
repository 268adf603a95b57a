"""Figure 7: the QA tasks with the attention-only model (K = 19, M = 1000, N(0, 0.01^2), lr 0.1, 100 steps).

The paper's runs use unit-normalised x~ in the attention; the unnormalised reading is run too, to
show that the QA results depend on it (``docs/model.md`` section 6). Task 1 is also run with the
other seeds of :data:`~experiments.specs._qa.SEEDS`, as in Fig 10, where no seed learns it.
"""

import dataclasses

from experiments.spec import Claim, Computed, at_least
from experiments.specs._qa import QA_MODEL, SEED_RUNS, SEEDS, ending_at_one, qa_figure, seed_panel, seed_runs

TRAIN = {"lr": 0.1, "eps": 0.1, "steps": 100, "n_train": 1000, "n_test": 1000}

SPEC = dataclasses.replace(qa_figure(
    "7", "question answering beyond random walks (attention only)", QA_MODEL, TRAIN,
    readings=[("raw_", "large-norm x~ (not normalised)", {**QA_MODEL, "normalize_tokens": False}, TRAIN,
               "not the paper's setting: shows that the result depends on normalising x~ (docs/model.md section 6)",
               False)],
    extra_runs=seed_runs(QA_MODEL, TRAIN),
    extra_claims=[Claim(f"[the paper's setting, seeds 0 to {SEEDS[-1]}] task 1 ends at 100% for every seed",
                        Computed(lambda r: ending_at_one(r, SEED_RUNS)), at_least(len(SEEDS)),
                        note="measured: how many seeds end at 100% test accuracy (initialisation and sentences "
                             "drawn from each seed); panel (e)")],
    extra_panels=[seed_panel("(e) task 1: test accuracy by seed")],
    caption_note=("Both hold here; (e): task 1 is learned for every seed. With large-norm x~ (not normalised), "
                  "the two tasks were expected to come out reversed (docs/model.md section 6); here neither is "
                  "learned: task 1 stays at 0 (the model answers every list with a word that is not a fruit) and "
                  "task 2 at 50%."),
), shortfall="The one claim that fails is an expectation outside the paper's setting: with large-norm x~ (not normalised) neither task is learned, instead of the two coming out reversed.")
