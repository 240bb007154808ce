"""Task registry: correct answers, the char-level vocabulary, and held-out sets disjoint by construction."""

from __future__ import annotations

import random
import string

import pytest

from jetroll.functions.runner import get_reward
from jetroll.shared.evaluate import scoring_problems
from jetroll.shared.tasks.arithmetic import ArithmeticTask
from jetroll.shared.tasks.base import Problem, Task
from jetroll.shared.tasks.count import CountTask
from jetroll.shared.tasks.registry import TASKS, TaskSet, register_task

VOCAB = set("0123456789+-=*/:;,.?!()[] \n" + string.ascii_lowercase)


@pytest.mark.parametrize("name", ["arithmetic", "count", "calculator"])
def test_heldout_disjoint_from_training(name: str) -> None:
    task = TASKS[name]
    heldout = task.heldout(200)
    assert len(set(heldout)) == 200
    assert task.heldout(200) == heldout  # deterministic
    rng = random.Random(123)
    training = {task.sample(rng) for _ in range(50_000)}
    assert not training & set(heldout)
    assert {p.prompt for p in training}.isdisjoint(p.prompt for p in heldout)


@pytest.mark.parametrize("name", ["arithmetic", "count", "calculator"])
def test_probe_disjoint_from_training_and_heldout(name: str) -> None:
    """The warm start stops on the probe set, so it must not select on the set RL is scored on."""
    task = TASKS[name]
    probe = task.probe(200)
    assert len(set(probe)) == 200 and task.probe(200) == probe
    assert set(probe).isdisjoint(task.heldout(2000))
    rng = random.Random(7)
    assert {task.sample(rng) for _ in range(50_000)}.isdisjoint(probe)


@pytest.mark.parametrize("name", ["arithmetic", "calculator"])
def test_jetroll_eval_split_train_scores_a_fixed_draw_of_training_problems(name: str) -> None:
    """`jetroll eval --split train`: the same problems every time, drawn as the job draws its training problems,
    none of them held out."""
    task = TASKS[name]
    train = scoring_problems(TASKS[name], "train", 300)
    assert len(train) == 300 and scoring_problems(TASKS[name], "train", 300) == train
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in task.heldout(2000))
    assert scoring_problems(TASKS[name], "heldout", 50) == task.heldout(50)
    rng = random.Random(f"{name}-train-eval")
    assert train[:20] == [task.sample(rng, index) for index in range(1, 21)]


@pytest.mark.parametrize("name", ["arithmetic", "count"])
def test_registered_task_is_consistent(name: str) -> None:
    task = TASKS[name]
    assert isinstance(task, Task)
    assert task.name == name and callable(get_reward(task.reward))
    rng = random.Random(0)
    for p in [task.sample(rng) for _ in range(500)] + task.heldout(50):
        assert set(p.prompt) <= VOCAB and set(p.answer) <= VOCAB
        assert task.sft_completion(p) == p.answer
        assert len(p.answer) + 1 <= task.max_new_tokens  # room for EOS
        assert get_reward(task.reward)(task.sft_completion(p), p.answer).correct


def test_arithmetic_answers() -> None:
    task = TASKS["arithmetic"]
    rng = random.Random(1)
    ops = set()
    for _ in range(2000):
        p = task.sample(rng)
        op = "+" if "+" in p.prompt else "-"
        ops.add(op)
        left, right = p.prompt.removesuffix("=").split(op)
        assert 0 <= int(left) <= 999 and 0 <= int(right) <= 999
        assert int(p.answer) == (int(left) + int(right) if op == "+" else int(left) - int(right))
    assert ops == {"+", "-"}
    assert ArithmeticTask.make(57, "-", 912) == Problem("57-912=", "-855")


def test_count_answers_are_long_and_right() -> None:
    task = TASKS["count"]
    rng = random.Random(2)
    for p in [task.sample(rng) for _ in range(300)] + task.heldout(20):
        start, step = (int(x) for x in p.prompt.removeprefix("count ").rstrip(":").split(" by "))
        numbers = [int(x) for x in p.answer.split(" ")]
        assert numbers == [start + step * i for i in range(1, 129)]
        assert len(p.answer) >= 512
    assert task.max_new_tokens >= len(p.answer) + 16 > 512
    with pytest.raises(ValueError, match="4-digit"):
        CountTask(max_start=9000)


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'; valid: \[") as refused:
        TaskSet()["nope"]
    # the built-in tasks, sorted; tasks other tests' configs registered in this process sort among them
    named = [name for name in ("arithmetic", "calculator", "count") if f"'{name}'" in str(refused.value)]
    assert named == ["arithmetic", "calculator", "count"]
    with pytest.raises(ValueError, match="already registered"):
        register_task(ArithmeticTask(max_new_tokens=9))
    assert register_task(ArithmeticTask()) is not None  # re-registering the same task is harmless


def test_calculator_transcripts_use_the_tool_part_of_the_time() -> None:
    task = TASKS["calculator"]
    reward = get_reward(task.reward)
    rng = random.Random(3)
    problems = [task.sample(rng) for _ in range(2000)]
    num_tool = {True: 0, False: 0}
    for p in problems:
        a, b = (int(x) for x in p.prompt.removesuffix("=").split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and p.answer == str(a * b)
        completion = task.sft_completion(p)
        assert set(p.prompt + completion) <= VOCAB and len(completion) + 1 <= task.max_new_tokens
        assert reward(completion, p.answer).correct
        turns = task.sft_turns(p)
        assert completion == "".join(t + (task.turn_end + o if o else "") for t, o in turns) and turns[-1][1] == ""
        if len(turns) == 2:
            assert turns[0] == (f"call {a}*{b}", f"= {a * b}\n")
        num_tool[a < task.low_below] += len(turns) == 2
    num_low = sum(int(p.prompt.split("*")[0]) < task.low_below for p in problems)
    assert abs(num_tool[True] / num_low - task.tool_rate_low) < 0.06
    assert abs(num_tool[False] / (len(problems) - num_low) - task.tool_rate) < 0.04
