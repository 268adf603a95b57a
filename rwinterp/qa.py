"""The paper's question-answering tasks "beyond random walks" (``docs/model.md`` section 5), as :class:`Task` s.

Both are sentences over one vocabulary of 19 words, one-hot encoded in this order (token ``i`` is
``VOCAB[i]``; punctuation is dropped and token 19 is the query slot)::

    apple orange Based on the which type of fruit list appears most frequently sentence I prefer an to do

* :class:`QAMajority` (task 1): "Based on the list f1 f2 f3 f4 f5 which type of fruit appears most
  frequently", each ``f_i`` apple or orange, all 32 lists equally likely; the label is the fruit
  that appears most often. 16 words, N = 17.
* :class:`QAOrder` (task 2): "Based on the sentence I prefer an A to an B which type of fruit do I
  prefer", ``(A, B)`` = (apple, orange) or (orange, apple) equally likely; the label is A.
  18 words, N = 19.

The label is a deterministic function of the words, so the Bayes accuracy is 1; the label's
*parents* are the fruit positions. The paper's point: a model that attends near-uniformly sees the
bag of words. For task 1 the bag decides the answer (the majority fruit has the larger count); for
task 2 both sentences have the same bag, so such a model cannot beat 50%, which is how the
deterministic walk stalls.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.errors import require
from rwinterp.tasks import Batch, Task, register_task

#: The 19 words, in the paper's order; token ``i`` is ``VOCAB[i]``.
VOCAB: tuple[str, ...] = ("apple", "orange", "Based", "on", "the", "which", "type", "of", "fruit", "list",
                          "appears", "most", "frequently", "sentence", "I", "prefer", "an", "to", "do")
FRUITS: tuple[str, ...] = ("apple", "orange")
#: A fruit slot in a sentence template.
SLOT = None


def token_of(word: str) -> int:
    require(word in VOCAB, f"{word!r} is not in the QA vocabulary")
    return VOCAB.index(word)


class QATask(Task):
    """A sentence template with fruit slots; the label is a rule on the fruits in the slots.

    Subclasses give the ``TEMPLATE`` (words, ``SLOT`` for a fruit), the fruit assignments that occur
    (all equally likely) and the label rule.
    """

    TEMPLATE: tuple[str | None, ...]
    sample_name = "sentence"

    @classmethod
    @abstractmethod
    def assignments(cls) -> list[tuple[str, ...]]:
        """Every tuple of fruits for the slots that occurs, each with equal probability."""

    @classmethod
    @abstractmethod
    def label_of(cls, fruits: Sequence[str]) -> str:
        """The answer for the fruits in the slots."""

    @property
    def n_states(self) -> int:
        return len(VOCAB)

    @property
    def seq_len(self) -> int:
        return len(self.TEMPLATE) + 1

    def parent_positions(self) -> tuple[int, ...]:
        """The fruit slots (0-indexed positions in the tokens)."""
        return tuple(i for i, w in enumerate(self.TEMPLATE) if w is SLOT)

    def params(self) -> dict[str, Any]:
        return {}

    def sentence(self, fruits: Sequence[str]) -> list[str]:
        words, fill = [], iter(fruits)
        for w in self.TEMPLATE:
            words.append(next(fill) if w is SLOT else w)
        return words

    def decode(self, tokens: Int[Tensor, " pos"]) -> str:
        """The words of one sample (the query slot shown as ``?``)."""
        return " ".join("?" if int(t) == self.query_token else VOCAB[int(t)] for t in tokens)

    def population_size(self) -> int:
        return len(self.assignments())

    def population(self) -> Batch:
        rows, labels = [], []
        for fruits in self.assignments():
            rows.append([token_of(w) for w in self.sentence(fruits)] + [self.query_token])
            labels.append(token_of(self.label_of(fruits)))
        tokens = torch.tensor(rows, dtype=torch.long)
        labels_t = torch.tensor(labels, dtype=torch.long)
        weights = torch.full((len(rows),), 1.0 / len(rows), dtype=torch.float64)
        states = tokens.clone()
        states[:, -1] = labels_t
        return Batch(tokens, labels_t, weights, states)

    def sample(self, n: int, seed: int) -> Batch:
        require(isinstance(n, int) and n >= 1, f"the number of samples must be >= 1, got {n}")
        pop = self.population()
        gen = torch.Generator().manual_seed(int(seed))
        idx = torch.randint(len(pop), (n,), generator=gen)
        return Batch(pop.tokens[idx], pop.labels[idx], None, pop.states[idx])

    def conditional(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """One-hot on the answer: the label is a function of the fruits in the slots."""
        slots = list(self.parent_positions())
        fruit_tokens = tokens[:, slots]
        require(bool(((fruit_tokens == 0) | (fruit_tokens == 1)).all()),
                "every fruit slot must hold 'apple' or 'orange'")
        answers = [token_of(self.label_of([VOCAB[int(t)] for t in row])) for row in fruit_tokens]
        return F.one_hot(torch.tensor(answers, dtype=torch.long), self.n_states).to(torch.float64)

    def bayes_accuracy(self) -> float:
        return 1.0


@register_task
class QAMajority(QATask):
    """Task 1: which fruit appears most often in a list of five (all 32 lists equally likely)."""

    kind = "qa_majority"
    TEMPLATE = ("Based", "on", "the", "list", SLOT, SLOT, SLOT, SLOT, SLOT,
                "which", "type", "of", "fruit", "appears", "most", "frequently")

    @classmethod
    def assignments(cls) -> list[tuple[str, ...]]:
        return list(itertools.product(FRUITS, repeat=5))

    @classmethod
    def label_of(cls, fruits: Sequence[str]) -> str:
        apples = sum(f == "apple" for f in fruits)
        return "apple" if 2 * apples > len(fruits) else "orange"


@register_task
class QAOrder(QATask):
    """Task 2: "I prefer an A to an B ... which do I prefer" (A = apple or orange, B the other)."""

    kind = "qa_order"
    TEMPLATE = ("Based", "on", "the", "sentence", "I", "prefer", "an", SLOT, "to", "an", SLOT,
                "which", "type", "of", "fruit", "do", "I", "prefer")

    @classmethod
    def assignments(cls) -> list[tuple[str, ...]]:
        return [("apple", "orange"), ("orange", "apple")]

    @classmethod
    def label_of(cls, fruits: Sequence[str]) -> str:
        return fruits[0]
