"""`model.chat_template` through the service that reads it: the controller admits each group with its prompt rendered
by the model's chat template (and `model.system_prompt`), so rollout decodes after the generation prompt."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from chat_models import QWEN_TEMPLATE, bpe_model_dir

from jetroll.functions.scoring import job_tasks
from jetroll.services.controller.controller import Controller
from jetroll.shared.config.job import validate_config
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import GroupEvent, decode
from jetroll.shared.store import setup_store

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_the_controller_admits_prompts_as_the_job_formats_them(redis_url: str, tmp_path: Path, chat: bool) -> None:
    directory = bpe_model_dir(tmp_path / "model", QWEN_TEMPLATE)
    job = f"c{uuid.uuid4().hex[:8]}"
    model = {"path": str(directory), "chat_template": chat, "system_prompt": "Answer with a number." if chat else None}
    config = validate_config({"job_id": job, "model": model, "trainer": {"groups_per_step": 2, "group_size": 2},
                              "store": {"root": str(tmp_path / "store")}})
    tokenizer = load_tokenizer(directory)

    async def admitted() -> list[GroupEvent]:
        bus = RedisBus(redis_url, job)
        try:
            controller = Controller(config, job_tasks(config), bus, setup_store(config.store, job, tmp_path), tmp_path)
            await controller._admit()
            return [decode(fields[b"e"]) for _, fields in await bus.redis.xrange(bus.key("groups:default"))]
        finally:
            await bus.close()

    events = asyncio.run(admitted())
    assert events
    for event in events:
        expected = (f"<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n{event.prompt}<|im_end|>\n"
                    "<|im_start|>assistant\n") if chat else event.prompt
        assert event.prompt_ids.numpy().tolist() == tokenizer.encode(expected)
