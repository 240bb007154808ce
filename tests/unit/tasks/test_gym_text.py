"""`kind: gymnasium` tasks: FrozenLake-v1 through gymnasium.make, as ROLL runs it, in the char model's vocabulary."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jetroll.functions.builtin import gymnasium_reward
from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.tasks.env import EnvStep, is_multi_turn
from jetroll.shared.tasks.gym_text import GymProblem, GymTask, GymTaskConfig
from jetroll.shared.warm_start import config_hash

pytest.importorskip("gymnasium", reason="kind: gymnasium needs the gym extra")
REPO = Path(__file__).resolve().parents[3]


def frozenlake(**fields: object) -> GymTask:
    return GymTaskConfig.model_validate({"kind": "gymnasium", "name": "frozenlake", **fields}).build(0, {})


def run_episode(task: GymTask, problem_answer: str, turns: list[str]) -> list[EnvStep]:
    async def episode() -> list[EnvStep]:
        env = task.make_env()
        await env.reset(task.make(GymProblem.parse(problem_answer).options))
        steps = []
        for turn in turns:
            steps.append(await env.step(turn))
            if steps[-1].done:
                break
        return steps

    return asyncio.run(episode())


def test_each_problem_is_its_own_seeded_map_and_the_held_out_maps_are_never_trained_on() -> None:
    task = frozenlake()
    assert is_multi_turn(task)
    draws = [task.sample(random.Random(seed), 1) for seed in range(200)]
    assert draws[:20] == [task.sample(random.Random(seed), 1) for seed in range(20)]  # a function of the draw's rng
    maps = {GymProblem.parse(p.answer).options for p in draws}
    assert len(maps) > 100  # generate_random_map's maps (4x4 ones repeat), not gymnasium's one default map
    heldout = {GymProblem.parse(p.answer).options for p in task.heldout(50)}
    assert len(heldout) == 50 and not heldout & maps
    assert {GymProblem.parse(p.answer).options for p in task.probe(10)}.isdisjoint(heldout | maps)
    for options in maps:
        rows = options.split("/")
        assert len(rows) == 4 and all(len(r) == 4 for r in rows) and options[0] == "s" and options[-1] == "g"


def test_the_text_is_in_the_char_models_vocabulary_and_the_solver_reaches_the_goal() -> None:
    task = frozenlake(options={"size": 5})
    tokenizer = build_char_tokenizer()
    for problem in task.heldout(20):
        completion = task.sft_completion(problem)
        tokenizer.encode(problem.prompt + completion)  # a closed alphabet refuses what it lacks
        assert gymnasium_reward(completion, problem.answer).reward == 1.0
        assert problem.prompt.endswith(" at 0 0\n") and completion.split("\n")[-1] in task.adapter.actions


def test_moves_step_the_environment_unslippery_and_a_turn_that_does_not_parse_is_a_bad_move() -> None:
    task = frozenlake()
    answer = task.make("sfff/fhfh/fffh/hffg").answer
    steps = run_episode(task, answer, ["right", "jump!", "", "down"])
    assert [s.observation for s in steps[:-1]] == ["at 0 1\n", "at 0 1\n", "at 0 1\n"]  # (1, 1) is a hole
    assert steps[-1] == EnvStep(done=True, reward=0.0)
    path = ["down", "down", "right", "right", "down", "right"]
    steps = run_episode(task, answer, path)
    assert steps[-1] == EnvStep(done=True, reward=1.0)
    # the episode's transcript as rollout writes it (each turn with its turn end, then the observation) scores 1
    transcript = "".join(f"{move}\n{step.observation}" for move, step in zip(path, steps, strict=True))
    assert transcript.startswith("down\nat 1 0\ndown\nat 2 0\n") and gymnasium_reward(transcript, answer).correct


def test_the_neighbours_view_names_the_cell_each_move_reaches_and_the_reward_replays_it() -> None:
    task = frozenlake(options={"view": "neighbours"})
    problem = task.make("sfff/fhfh/fffh/hffg")
    assert problem.prompt == "sfff/fhfh/fffh/hffg at 0 0 - f f -\n"
    steps = run_episode(task, problem.answer, ["down", "right"])
    assert steps[0].observation == "at 1 0 - f h s\n" and steps[1] == EnvStep(done=True, reward=0.0)
    completion = task.sft_completion(problem)
    assert completion.startswith("down\nat 1 0 - f h s\ndown\nat 2 0 - h f f\n")
    assert gymnasium_reward(completion, problem.answer).reward == 1.0
    assert task.fingerprint() != frozenlake().fingerprint()  # another view is another base
    with pytest.raises(Exception, match="FrozenLake view 'grid' is not one of"):
        validate_config({"tasks": [{"kind": "gymnasium", "name": "lake", "options": {"view": "grid"}}]})


def test_an_episode_that_runs_out_of_turns_ends_unsolved() -> None:
    task = frozenlake(max_turns=3)
    answer = task.make("sfff/fhfh/fffh/hffg").answer
    steps = run_episode(task, answer, ["left"] * 5)
    assert len(steps) == 3 and steps[-1] == EnvStep(done=True, reward=0.0)
    assert gymnasium_reward("left\nat 0 0\nleft\nat 0 0\nleft", answer).reward == 0.0
    assert gymnasium_reward("down\nat 1 0\n", answer).correct is False  # cut off: never ended


def test_a_job_config_builds_the_task_and_refuses_what_it_cannot_run() -> None:
    config = validate_config({"tasks": [{"kind": "gymnasium", "name": "lake", "options": {"size": 6}}]})
    task = config.build_tasks()["lake"]
    assert isinstance(task, GymTask) and task.adapter.size == 6 and config.tasks[0].name == "lake"
    with pytest.raises(Exception, match="no text adapter for gymnasium env 'CartPole-v1'"):
        validate_config({"tasks": [{"kind": "gymnasium", "name": "pole", "env_id": "CartPole-v1"}]})
    with pytest.raises(ConfigError, match="reward 'gymnasium' replays the task through jetroll.shared"):
        job_tasks(validate_config({"tasks": [{"kind": "gymnasium", "name": "lake"}], "reward": {"backend": "lambda"}}))
    with pytest.raises(Exception, match="unexpected keyword argument 'holes'"):
        validate_config({"tasks": [{"kind": "gymnasium", "name": "lake", "options": {"holes": 3}}]})


def test_the_base_a_warm_start_builds_follows_the_environments_options() -> None:
    def base_key(options: dict[str, object]) -> str:
        config = validate_config({"model": {"warm_start": {"tasks": ["lake"]}},
                                  "tasks": [{"kind": "gymnasium", "name": "lake", "options": options}]})
        return config_hash(config.model, config.build_tasks())

    assert base_key({}) == base_key({"size": 4})
    assert base_key({}) != base_key({"size": 6})  # bigger maps are another base, never the cached 4x4 one


@pytest.mark.integration  # a fresh interpreter without gymnasium
def test_without_the_extra_a_gymnasium_task_fails_the_config_in_one_line_naming_it() -> None:
    code = ("import sys; sys.modules['gymnasium'] = None\n"
            "from jetroll.shared.config.job import validate_config\n"
            "validate_config({'tasks': [{'kind': 'gymnasium', 'name': 'lake'}]})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "gymnasium needs the `gym` extra: pip install 'jetroll[gym]'" in run.stderr


def test_your_own_environment_and_adapter_by_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/guess_number.py, as the README's "Your own environment" runs it: gymnasium imports the module that
    registers the env, the adapter comes from its import path, and the reward replays the episode through both."""
    monkeypatch.syspath_prepend(str(REPO))
    config = validate_config({"tasks": [{"kind": "gymnasium", "name": "guess", "max_turns": 10,
                                         "env_id": "examples.guess_number:GuessNumber-v0",
                                         "adapter": "examples.guess_number:GuessText"}]})
    task = config.build_tasks()["guess"]
    assert isinstance(task, GymTask) and type(task.adapter).__name__ == "GuessText"
    problem = task.heldout(1)[0]
    secret = GymProblem.parse(problem.answer).options
    assert problem.prompt == "guess a number from 0 to 999: start\n" and secret not in problem.prompt
    moves = task.adapter.solution(secret)
    steps = run_episode(task, problem.answer, moves)
    assert steps[-1] == EnvStep(done=True, reward=1.0) and all(s.observation in ("higher\n", "lower\n")
                                                               for s in steps[:-1])
    assert gymnasium_reward(task.sft_completion(problem), problem.answer).reward == 1.0
    assert gymnasium_reward("500\n", problem.answer).reward == (1.0 if secret == "500" else 0.0)
    for bad, needle in [("examples.guess_number:NoSuchText", "examples.guess_number has no NoSuchText"),
                        ("no_such_module:Text", "cannot import no_such_module")]:
        with pytest.raises(ConfigError, match=needle):
            validate_config({"tasks": [{"kind": "gymnasium", "name": "guess", "adapter": bad}]})
    with pytest.raises(ConfigError, match="adapter"):
        validate_config({"tasks": [{"kind": "gymnasium", "name": "guess", "adapter": "not an import path"}]})
