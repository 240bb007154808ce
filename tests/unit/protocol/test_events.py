"""The codec refuses what it cannot read whole: arrays whose shape and bytes disagree, schemas it does not know, and
a metrics event of the old one-value layout."""

from __future__ import annotations

import msgspec
import pytest

from jetroll.shared.protocol.events import Array, EventDecodeError, MetricsEvent, decode, encode


def test_an_array_whose_shape_and_bytes_disagree_does_not_decode() -> None:
    event = MetricsEvent(job_id="j", service="s", values={"x": 1.0}, step=0)
    for shape, data, reason in [((3,), b"\0" * 8, "needs 12 bytes, got 8"),
                                ((-1, -2), b"\0" * 8, "negative dimension")]:
        payload = msgspec.msgpack.encode({"kind": "group", "job_id": "j", "group_id": "g", "task": "t", "pool": "p",
                                          "prompt": "", "answer": "", "prompt_ids": ["<i4", shape, data],
                                          "group_size": 1, "max_new_tokens": 1, "v_adm": 0})
        with pytest.raises(EventDecodeError, match=reason):
            decode(payload)
    assert decode(encode(event)) == event
    assert Array.of([[1, 2], [3, 4]], "<i4").numpy().tolist() == [[1, 2], [3, 4]]


def test_schemas_it_does_not_read_and_the_old_metrics_layout_are_refused() -> None:
    old_metric = {"kind": "metrics", "schema": 1, "job_id": "j", "service": "trainer", "name": "loss", "value": 1.0,
                  "step": 3}
    with pytest.raises(EventDecodeError, match="values"):
        decode(msgspec.msgpack.encode(old_metric))
    with pytest.raises(EventDecodeError, match=r"unsupported schema 99; this build reads \[1, 2\]"):
        decode(msgspec.msgpack.encode({**old_metric, "schema": 99, "values": {"loss": 1.0}}))
