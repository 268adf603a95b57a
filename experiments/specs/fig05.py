"""Figure 5: K = 6, N = 97, p = 1 (deterministic walk), zero initialisation: nothing is learned."""

from experiments.specs._walk import failure_figure

SPEC = failure_figure("5", K=6, N=97)
