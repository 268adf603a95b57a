"""Figure 9: Figure 5 with K = 20, N = 101 (p = 1): expected accuracy about 1/20."""

from experiments.specs._walk import failure_figure

NOTE = ("Holds because training keeps equal numbers equal: the value read-out adds its products in one order for "
        "every entry, the positional gradient adds the walks up in order, and gradient descent rounds its multiply "
        "and its subtract separately (rwinterp.model.SymmetricReadout, rwinterp.model.SeparableAttention, "
        "rwinterp.training.GradientDescent), so V's columns get bit-identical updates. A plain matmul read-out or "
        "torch.optim.SGD's fused update rounds the edge columns of a SIMD block differently, which seeds an "
        "asymmetry that gradient descent amplifies until the model learns the walk by attending to every 20th "
        "position. Sine embeddings still break it: the fragility study gives the step for each precision.")

SPEC = failure_figure("9", K=20, N=101, note=NOTE)
