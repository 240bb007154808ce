"""`jetroll config`: every field of the job config, with its default and description, from the classes that
validate it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from config_tree import config_classes, models_in

from jetroll.services.cli import main
from jetroll.shared.config.reference import field_docs
from jetroll.shared.config.rollout import RolloutConfig
from jetroll.shared.config.trainer import TrainerConfig


def test_every_leaf_field_of_every_config_class_is_listed_with_a_description() -> None:
    docs = field_docs()
    listed = {(doc.section, doc.path.rsplit(".", 1)[-1]) for doc in docs}
    leaves = {(name, field) for name, cls in config_classes().items() for field, info in cls.model_fields.items()
              if not models_in(info.annotation)}
    assert len(leaves) > 100 and leaves <= listed, sorted(leaves - listed)
    assert [doc.path for doc in docs if not doc.description] == []


def test_defaults_and_paths_are_the_classes_own() -> None:
    docs = {doc.path: doc for doc in field_docs()}
    assert docs["trainer.max_steps"].default == repr(TrainerConfig().max_steps)
    assert docs["rollout.engine"].default == repr(RolloutConfig().engine)
    assert docs["rollout.engine"].type == "'jetroll' | 'vllm' | 'timing'"
    assert docs["rollout.pools[].name"].default == "required"
    assert docs["job_id"].default == "generated per job"
    # a section that holds its own class again is one field, not an endless walk
    assert docs["model.warm_start.init_from"].type == "WarmStartConfig | None"
    assert not any(path.startswith("model.warm_start.init_from.") for path in docs)


def test_the_cli_lists_a_section_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "model.warm_start", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["path"].startswith("model.warm_start.") for row in rows)
    assert {"model.warm_start.max_steps", "model.warm_start.init_from"} <= {row["path"] for row in rows}
    assert main(["config", "trainer"]) == 0
    text = capsys.readouterr().out
    paths = [line.split()[0] for line in text.splitlines() if not line.startswith(" ")]
    assert "trainer.max_steps" in paths and all(path.startswith("trainer.") for path in paths), paths
    with pytest.raises(SystemExit) as exited:
        main(["config", "trainers"])
    assert exited.value.code == 2
    assert "no config field under 'trainers'; sections: eval, job_id," in capsys.readouterr().err


@pytest.mark.integration  # the CLI as a subprocess
def test_a_reader_that_leaves_early_ends_the_listing_quietly() -> None:
    """`jetroll config | head`: the pipe closes before the listing is written; no traceback, the SIGPIPE exit code."""
    listing = subprocess.Popen([sys.executable, "-m", "jetroll.services.cli", "config"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    listing.stdout.close()  # before the CLI has imported its config classes, so its first write finds no reader
    _, err = listing.communicate(timeout=120)
    assert listing.returncode == 128 + signal.SIGPIPE and b"Traceback" not in err, err.decode()[-2000:]
