"""Figure 7: the QA tasks with the attention-only model (K = 19, M = 1000, N(0, 0.01^2), lr 0.1, 100 steps).

The paper's runs use unit-normalised x~ in the attention; the unnormalised reading is run too, to
show PAPER.md section 5's observation that the QA results depend on it.
"""

from experiments.specs._qa import QA_MODEL, qa_figure

TRAIN = {"lr": 0.1, "eps": 0.1, "steps": 100, "n_train": 1000, "n_test": 1000}

SPEC = qa_figure(
    "7", "question answering beyond random walks (attention only)", QA_MODEL, TRAIN,
    readings=[("raw_", "large-norm x~ (not normalised)", {**QA_MODEL, "normalize_tokens": False}, TRAIN,
               "not the paper's setting: shows that the result depends on normalising x~ (PAPER.md section 5)", False)],
)
