"""The QA tasks: vocabulary order, exact label rules, populations, parents, sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rwinterp.errors import RwinterpError
from rwinterp.metrics import predict
from rwinterp.qa import VOCAB, QAMajority, QAOrder
from rwinterp.tasks import task_from_dict
from tests.conftest import assert_close

PAPER_VOCAB = ("apple orange Based on the which type of fruit list appears most frequently sentence I prefer "
               "an to do").split()


def test_vocabulary_is_the_papers_in_order():
    assert list(VOCAB) == PAPER_VOCAB
    assert QAMajority().n_states == QAOrder().n_states == 19
    assert QAMajority().query_token == 19


def test_task1_has_32_equally_likely_lists_with_majority_labels():
    task = QAMajority()
    pop = task.population()
    assert task.seq_len == 17 and pop.tokens.shape == (32, 17) and task.population_size() == 32
    assert_close(pop.weights, torch.full((32,), 1 / 32, dtype=torch.float64))
    fruit_lists = {tuple(row[4:9].tolist()) for row in pop.tokens}
    assert fruit_lists == set(itertools.product((0, 1), repeat=5))
    for row, label in zip(pop.tokens, pop.labels):
        words = [VOCAB[t] for t in row[:-1]]
        apples, oranges = words.count("apple"), words.count("orange")
        assert apples + oranges == 5
        assert VOCAB[int(label)] == ("apple" if apples > oranges else "orange")
        assert int(row[-1]) == 19
    assert task.decode(pop.tokens[0]) == ("Based on the list apple apple apple apple apple which type of fruit "
                                          "appears most frequently ?")
    assert int((pop.labels == 0).sum()) == 16


def test_task2_has_two_sentences_labelled_with_the_preferred_fruit():
    task = QAOrder()
    pop = task.population()
    assert task.seq_len == 19 and pop.tokens.shape == (2, 19) and task.population_size() == 2
    sentences = {task.decode(row): VOCAB[int(label)] for row, label in zip(pop.tokens, pop.labels)}
    assert sentences == {
        "Based on the sentence I prefer an apple to an orange which type of fruit do I prefer ?": "apple",
        "Based on the sentence I prefer an orange to an apple which type of fruit do I prefer ?": "orange",
    }
    counts = [torch.bincount(row, minlength=20) for row in pop.tokens]
    assert torch.equal(counts[0], counts[1])  # the same bag of words


def test_parents_are_the_fruit_positions():
    assert QAMajority().parent_positions() == (4, 5, 6, 7, 8)
    assert QAOrder().parent_positions() == (7, 10)
    for task in (QAMajority(), QAOrder()):
        pop = task.population()
        slots = list(task.parent_positions())
        assert bool((pop.tokens[:, slots] <= 1).all())
        others = [i for i in range(task.seq_len - 1) if i not in slots]
        assert bool((pop.tokens[:, others] >= 2).all())


def test_conditional_is_one_hot_on_the_label_and_bayes_accuracy_is_one():
    for task in (QAMajority(), QAOrder()):
        pop = task.population()
        cond = task.conditional(pop.tokens)
        assert torch.equal(cond.argmax(1), pop.labels)
        assert torch.equal(cond.sum(1), torch.ones(len(pop), dtype=torch.float64))
        assert task.bayes_accuracy() == 1.0
        assert torch.equal(predict(cond), pop.labels)
        assert torch.equal(pop.states[:, :-1], pop.tokens[:, :-1]) and torch.equal(pop.states[:, -1], pop.labels)


def test_conditional_rejects_a_non_fruit_in_a_slot():
    task = QAMajority()
    tokens = task.population().tokens[:1].clone()
    tokens[0, 4] = VOCAB.index("the")
    with pytest.raises(RwinterpError):
        task.conditional(tokens)


def test_sampling_is_reproducible_and_uniform_over_the_population():
    task = QAMajority()
    a, b = task.sample(4000, seed=3), task.sample(4000, seed=3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens, task.sample(4000, seed=4).tokens)
    assert torch.equal(task.conditional(a.tokens).argmax(1), a.labels)
    # Each of the 32 lists has probability 1/32: counts within 4.5 standard errors (all 32 at once).
    ids = (a.tokens[:, 4:9] * torch.tensor([16, 8, 4, 2, 1])).sum(1)
    counts = torch.bincount(ids, minlength=32).double()
    se = math.sqrt(4000 * (1 / 32) * (31 / 32))
    assert float((counts - 4000 / 32).abs().max()) < 4.5 * se
    share_apple = float((QAOrder().sample(4000, seed=1).labels == 0).double().mean())
    assert abs(share_apple - 0.5) < 4 * math.sqrt(0.25 / 4000)


def test_round_trip_through_task_dicts():
    for task in (QAMajority(), QAOrder()):
        again = task_from_dict(task.to_dict())
        assert type(again) is type(task)
        assert torch.equal(again.population().tokens, task.population().tokens)


def test_a_trained_qa_model_saves_and_loads(tmp_path):
    """The FC+ReLU variant on task 1 (m = 19): a saved run rebuilds the task and identical scores."""
    from rwinterp.model import DeepConfig, DeepTransformer
    from rwinterp.runs import load_run, save_run
    from rwinterp.training import TrainConfig, train

    task = QAMajority()
    model = DeepTransformer(DeepConfig.paper(19, task.seq_len, 40, init="gaussian", normalize_tokens=True,
                                             mlp_width=19, seed=1))
    config = TrainConfig(lr=0.1, steps=3, n_train=64, n_test=64)
    result = train(model, task, config, progress=False)
    save_run(tmp_path / "run", model, task, config.to_dict(), result.history, {})
    run = load_run(tmp_path / "run")
    assert isinstance(run.task, QAMajority)
    tokens = task.population().tokens
    assert torch.equal(run.model.scores(tokens), model.scores(tokens))
