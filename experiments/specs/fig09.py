"""Figure 9: Figure 5 with K = 20, N = 101 (p = 1): expected accuracy about 1/20."""

from experiments.specs._walk import failure_figure

NOTE = ("Holds because training keeps equal numbers equal: the value read-out and the positional gradient sum "
        "along the innermost axis and gradient descent rounds its multiply and its subtract separately "
        "(rwinterp.model.SymmetricReadout, rwinterp.training.GradientDescent), so V's columns get bit-identical "
        "updates. With a plain matmul read-out and torch.optim.SGD's fused update, V's columns first differed by "
        "about 1e-16 after 3 steps (edge columns of a SIMD block are rounded differently), the difference grew "
        "about tenfold per step and near step 18 the model broke the symmetry and learned the walk by attending "
        "to every 20th position. Sine embeddings still break it (step 15 in float64, 8 in float32): see the "
        "fragility study.")

SPEC = failure_figure("9", K=20, N=101, note=NOTE)
