"""Figure 4: K = 6, N = 97, p = 0.5, zero initialisation, lr 1, 50 steps of full-batch GD."""

from experiments.specs._walk import learning_figure

SPEC = learning_figure("4", K=6, N=97, p=0.5)
