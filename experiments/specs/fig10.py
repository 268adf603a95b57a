"""Figure 10 (appendix F.2): the QA tasks with the FC+ReLU layer, f = A ReLU(V X softmax(...)), m = 19.

The paper's setting: N(0, 0.01^2) on A, V, W, unit-normalised x~, lr 0.1, 100 steps, 1024/1024
sentences, loss -log(f_y + eps). Under it the model inflates the scores of both fruits alike (the
loss rewards a large f_y and never penalises the other scores), so task 1 is not learned. Softmax
cross-entropy with lr 1 is run as an alternative reading: it reproduces the paper's picture.
"""

from experiments.specs._qa import QA_MODEL, qa_figure

MODEL = {**QA_MODEL, "mlp_width": 19}
TRAIN = {"lr": 0.1, "eps": 0.1, "steps": 100, "n_train": 1024, "n_test": 1024}
NOTE = ("The stated loss -log(f_y + eps) rewards a large f_y and never penalises the other scores, so both "
        "fruit scores can grow together while their input-dependent difference stays small, and the model "
        "predicts one fruit for every list. Tried without success: lr 0.1 to 1000, 1000 steps, sigma 0.01 and "
        "0.1, normalised and raw x~, a balanced training set (each of the 32 lists 32 times, i.e. population "
        "mode). Softmax cross-entropy with lr 1 does learn task 1 (see the alternative reading).")

SPEC = qa_figure(
    "10", "question answering with an FC+ReLU layer (m = 19)", MODEL, TRAIN, claims_note=NOTE,
    readings=[("xent_", "softmax cross-entropy, lr 1", MODEL, {**TRAIN, "loss": "xent", "lr": 1.0},
               "not the paper's stated loss: an alternative reading under which Fig 10 reproduces", True)],
)
