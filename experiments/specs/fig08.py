"""Figure 8: Figure 4 with K = 20, N = 101 (training set size not stated: 1000 walks, as in Fig 4)."""

from experiments.specs._walk import learning_figure

SPEC = learning_figure("8", K=20, N=101, p=0.5)
