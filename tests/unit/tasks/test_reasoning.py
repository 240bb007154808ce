"""`kind: reasoning_gym` tasks: reasoning-gym's procedural datasets, split by jetroll's hash on the question and
scored by the dataset's own `score_answer`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from jetroll.functions.builtin import reasoning_gym_reward
from jetroll.shared.config.job import validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.tasks.reasoning import EntryRef, ReasoningGymTask
from jetroll.shared.warm_start import config_hash

pytest.importorskip("reasoning_gym", reason="kind: reasoning_gym needs the reasoning extra")
REPO = Path(__file__).resolve().parents[3]
BPE = str(REPO / "configs" / "models" / "bpe-math")


def task(name: str = "legs", seed: int = 0, **entry: object) -> ReasoningGymTask:
    config = validate_config({"seed": seed, "model": {"tokenizer": BPE},
                              "tasks": [{"kind": "reasoning_gym", "name": name, "dataset": "leg_counting", **entry}]})
    found = config.build_tasks()[name]
    assert isinstance(found, ReasoningGymTask)
    return found


def test_draws_are_a_function_of_the_jobs_seed_and_the_groups_rng() -> None:
    legs = task()
    assert [legs.sample(random.Random(i)) for i in range(5)] == [legs.sample(random.Random(i)) for i in range(5)]
    other_job = task(seed=1)
    assert [p.prompt for p in (legs.sample(random.Random(i)) for i in range(5))] != [
        p.prompt for p in (other_job.sample(random.Random(i)) for i in range(5))]


def test_held_out_questions_are_never_trained_on_whichever_seed_draws_them() -> None:
    heldout = {p.prompt for p in task().heldout(50)}
    probe = {p.prompt for p in task().probe(20)}
    assert len(heldout) == 50 and not heldout & probe
    assert task(seed=7).heldout(50) == task().heldout(50)  # the same held-out set in every job
    for seed in (0, 7):
        trained = {task(seed=seed).sample(random.Random(i)).prompt for i in range(400)}
        assert not trained & (heldout | probe)


def test_the_reward_is_the_datasets_own_score_and_the_warm_start_target_its_answer() -> None:
    legs = task()
    tokenizer = load_tokenizer(BPE)
    for problem in legs.heldout(10):
        target = legs.sft_completion(problem)
        assert target == str(EntryRef.parse(problem.answer).entry()["answer"])
        assert reasoning_gym_reward(f" {target}\n", problem.answer).reward == 1.0
        assert reasoning_gym_reward(str(int(target) + 1), problem.answer).reward == 0.0
        assert tokenizer.decode(tokenizer.encode(problem.prompt)) == problem.prompt  # byte-level: capitals and all


def test_the_warm_start_draws_the_same_for_every_job_seed_and_its_base_follows_the_tasks_options() -> None:
    def base_key(seed: int, options: dict[str, object]) -> str:
        config = validate_config({"seed": seed, "model": {"tokenizer": BPE, "warm_start": {"tasks": ["legs"]}},
                                  "tasks": [{"kind": "reasoning_gym", "name": "legs", "dataset": "leg_counting",
                                             "options": options}]})
        return config_hash(config.model, config.build_tasks())

    warm_draws = [task(seed=0).sft_sample(random.Random(i)) for i in range(5)]
    assert [task(seed=9).sft_sample(random.Random(i)) for i in range(5)] == warm_draws
    assert base_key(0, {}) == base_key(9, {})  # one base for every job seed
    assert base_key(0, {}) != base_key(0, {"max_animals": 5})  # a harder dataset is another base, never the cached one


def test_a_config_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="char vocabulary cannot spell"):
        validate_config({"tasks": [{"kind": "reasoning_gym", "name": "legs", "dataset": "leg_counting"}]})
    with pytest.raises(ConfigError, match="reasoning_gym task bad: .*no_such_dataset"):
        validate_config({"model": {"tokenizer": BPE},
                         "tasks": [{"kind": "reasoning_gym", "name": "bad", "dataset": "no_such_dataset"}]})
    assert task(options={"min_animals": 2, "max_animals": 2}).options == (("max_animals", 2), ("min_animals", 2))


@pytest.mark.integration  # a fresh interpreter without reasoning-gym
def test_without_the_extra_a_reasoning_gym_task_fails_the_config_in_one_line_naming_it() -> None:
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "from jetroll.shared.config.job import validate_config\n"
            "validate_config({'tasks': [{'kind': 'reasoning_gym', 'name': 'legs', 'dataset': 'leg_counting'}]})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "reasoning-gym needs the `reasoning` extra: pip install 'jetroll[reasoning]'" in (
        run.stderr)
