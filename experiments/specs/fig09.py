"""Figure 9: Figure 5 with K = 20, N = 101 (p = 1): expected accuracy about 1/20."""

from experiments.specs._walk import failure_figure

NOTE = ("Fails here because of round-off, not because the theorem is wrong: in float64 with exactly orthogonal "
        "embeddings V's columns first differ by about 1e-16 after 3 steps (the gradient of V sums the same numbers "
        "in a different order for each column), the difference grows about tenfold per step (panel e), and near "
        "step 18 the model breaks the symmetry and learns the walk by attending to every 20th position. Tried: "
        "sine embeddings (break at step 15), float32 (orthogonal: stays symmetric for 50 steps by round-off luck; "
        "sine: breaks at step 8); see the fragility study. The same round-off leaves K = 6 (Fig 5) untouched.")

SPEC = failure_figure("9", K=20, N=101, note=NOTE)
