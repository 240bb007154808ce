"""infra/: `terraform fmt` is clean, checkov finds nothing (few, justified skips, none on S3 encryption, S3 public
access or IAM wildcards), and the policies the design promises hold in the parsed HCL."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import hcl2
import pytest

from jetroll.functions.builtin import NOT_ON_LAMBDA  # and registers the built-in rewards
from jetroll.functions.registry import REWARDS
from jetroll.shared.config.reward import RewardConfig

pytestmark = pytest.mark.integration  # terraform, checkov and the Lambda zips' pip run as subprocesses

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
MAX_SKIPS = 8
# checkov ids whose skip would hide S3 encryption, S3 public access or IAM wildcard findings
FORBIDDEN_SKIPS = frozenset({
    # S3 encryption at rest
    "CKV_AWS_19", "CKV_AWS_145",
    # S3 public access: access block, public ACLs, public bucket policy, ACLs disabled
    "CKV_AWS_53", "CKV_AWS_54", "CKV_AWS_55", "CKV_AWS_56", "CKV2_AWS_6", "CKV_AWS_20", "CKV_AWS_57", "CKV_AWS_70",
    "CKV2_AWS_43", "CKV_AWS_375", "CKV2_AWS_65",
    # IAM wildcards: "*" actions, "*" resources for restrictable actions, unconstrained access, "*" principals
    "CKV_AWS_1", "CKV_AWS_49", "CKV_AWS_62", "CKV_AWS_63", "CKV_AWS_355", "CKV_AWS_356", "CKV_AWS_107",
    "CKV_AWS_108", "CKV_AWS_109", "CKV_AWS_110", "CKV_AWS_111", "CKV_AWS_286", "CKV_AWS_287", "CKV_AWS_288",
    "CKV_AWS_289", "CKV_AWS_290", "CKV2_AWS_40", "CKV_AWS_283", "CKV_AWS_33", "CKV_AWS_60", "CKV_AWS_61",
})
S3_READ_ONLY = ("s3:Get", "s3:List")


# --- tools ---


def _terraform() -> str:
    path = shutil.which("terraform") or ("/usr/local/bin/terraform" if Path("/usr/local/bin/terraform").is_file()
                                         else None)
    if path is None:
        pytest.fail("terraform is not installed: `terraform fmt -check` is an acceptance check of infra/ "
                    "(see infra/README.md)")
    return path


def _checkov() -> str:
    candidates = [os.environ.get("CHECKOV"), str(ROOT / ".venv-checkov" / "bin" / "checkov"), shutil.which("checkov")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("checkov not found (env CHECKOV, .venv-checkov/bin/checkov, PATH): run scripts/setup.sh")


def _run(cmd: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CLI_CONFIG_FILE": os.devnull}  # no ~/.terraformrc warning
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)


def test_terraform_fmt_is_clean() -> None:
    result = _run([_terraform(), "fmt", "-check", "-recursive", "-diff", "infra"])
    assert result.returncode == 0, f"terraform fmt would change:\n{result.stdout}{result.stderr}"


@functools.cache
def _checkov_report() -> dict[str, Any]:
    result = _run([_checkov(), "-d", "infra", "--framework", "terraform", "--skip-download", "-o", "json"])
    try:
        report = json.loads(result.stdout)
    except ValueError:
        pytest.fail(f"checkov printed no JSON (exit {result.returncode}):\n{result.stdout[-2000:]}{result.stderr}")
    reports = report if isinstance(report, list) else [report]
    (terraform,) = [r for r in reports if r.get("check_type") == "terraform"]
    return terraform


def test_checkov_has_no_failed_checks() -> None:
    report = _checkov_report()
    summary = report["summary"]
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
              for c in report["results"]["failed_checks"]]
    assert summary["failed"] == 0 and not failed, "checkov failures:\n" + "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 100 and summary["resource_count"] > 30, summary


def test_checkov_skips_are_few_justified_and_allowed() -> None:
    skipped = _checkov_report()["results"]["skipped_checks"]
    assert len(skipped) <= MAX_SKIPS, [c["check_id"] for c in skipped]
    for check in skipped:
        where = f"{check['check_id']} on {check['resource']}"
        assert check["check_id"] not in FORBIDDEN_SKIPS, f"{where} may not be skipped"
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason) >= 30, f"{where} is skipped without a real reason"


def test_forbidden_skip_ids_are_real_checkov_checks() -> None:
    listing = _run([_checkov(), "--list", "--framework", "terraform"]).stdout
    known = set(re.findall(r"\bCKV2?_AWS_\d+\b", listing))
    assert FORBIDDEN_SKIPS <= known, f"not checkov checks: {sorted(FORBIDDEN_SKIPS - known)}"


# --- the HCL, parsed ---


@functools.cache
def _hcl() -> dict[str, Any]:
    """Every top-level block of infra/*.tf: resource/data -> type -> name -> body; variable/locals -> name -> value."""
    options = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
    merged: dict[str, Any] = {"resource": {}, "data": {}, "variable": {}, "locals": {}}
    files = sorted(INFRA.glob("*.tf"))
    assert files, "infra/ has no .tf files"
    for path in files:
        parsed = hcl2.loads(path.read_text(), serialization_options=options)
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for type_, named in block.items():
                    for name, body in named.items():
                        assert name not in merged[kind].setdefault(type_, {}), f"{kind} {type_}.{name} twice"
                        merged[kind][type_][name] = body
        for block in parsed.get("variable", []):
            merged["variable"].update(block)
        for block in parsed.get("locals", []):
            merged["locals"].update(block)
    return merged


def _resources(type_: str) -> dict[str, Any]:
    return _hcl()["resource"].get(type_, {})


def _block(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The single nested block `name` (the parser gives blocks as one-element lists)."""
    value = body.get(name)
    assert isinstance(value, list) and len(value) == 1, f"expected one {name} block, got {value!r}"
    return value[0]


def _resolve(value: Any, depth: int = 5) -> Any:
    """Substitute `${var.x}` (its default) and `${local.x}` references, enough for literal policy checks."""
    if not isinstance(value, str) or depth == 0:
        return value
    whole = re.fullmatch(r"\$\{(var|local)\.(\w+)\}", value)
    if whole:
        kind, name = whole.groups()
        source = _hcl()["variable"][name]["default"] if kind == "var" else _hcl()["locals"][name]
        return _resolve(source, depth - 1)
    return re.sub(r"\$\{local\.(\w+)\}", lambda m: str(_resolve(_hcl()["locals"][m.group(1)], depth - 1)), value)


def _for_bucket(type_: str, bucket: str) -> list[dict[str, Any]]:
    refs = {f"${{aws_s3_bucket.{bucket}.id}}", f"${{aws_s3_bucket.{bucket}.bucket}}"}
    return [body for body in _resources(type_).values() if body.get("bucket") in refs]


def test_every_bucket_is_versioned_kms_encrypted_private_and_expires_old_versions() -> None:
    buckets = _resources("aws_s3_bucket")
    assert buckets, "no aws_s3_bucket in infra/"
    for name in buckets:
        versioning = _for_bucket("aws_s3_bucket_versioning", name)
        assert [_block(v, "versioning_configuration")["status"] for v in versioning] == ["Enabled"], name
        (sse,) = _for_bucket("aws_s3_bucket_server_side_encryption_configuration", name)
        default = _block(_block(sse, "rule"), "apply_server_side_encryption_by_default")
        assert default["sse_algorithm"] == "aws:kms" and default.get("kms_master_key_id"), name
        (block,) = _for_bucket("aws_s3_bucket_public_access_block", name)
        flags = ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
        assert all(block.get(flag) is True for flag in flags), (name, block)
        (lifecycle,) = _for_bucket("aws_s3_bucket_lifecycle_configuration", name)
        rules = [r for r in lifecycle["rule"] if r["status"] == "Enabled"]
        assert any("noncurrent_version_expiration" in r for r in rules), name
        assert any("abort_incomplete_multipart_upload" in r for r in rules), name
    (notification,) = _for_bucket("aws_s3_bucket_notification", "main")
    assert notification["eventbridge"] is True


def _walk_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _walk_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _walk_strings(v)]
    return []


def _all_actions() -> list[tuple[str, str]]:
    """(where, action) for every action in aws_iam_policy_document statements and in inline jsonencode policies."""
    found: list[tuple[str, str]] = []
    for name, doc in _hcl()["data"].get("aws_iam_policy_document", {}).items():
        for statement in doc.get("statement", []):
            found += [(f"data.aws_iam_policy_document.{name}", a)
                      for key in ("actions", "not_actions") for a in statement.get(key, [])]
    inline = re.compile(r"\b(?:Action|NotAction)\s*=\s*(\[[^\]]*\]|\"[^\"]*\")")
    for kind in ("resource", "data"):
        for type_, named in _hcl()[kind].items():
            for name, body in named.items():
                for text in _walk_strings(body):
                    for match in inline.finditer(text):
                        found += [(f"{type_}.{name}", a) for a in re.findall(r"\"([^\"]*)\"", match.group(1))]
    return found


def test_no_policy_statement_has_a_wildcard_action() -> None:
    actions = _all_actions()
    where = {w for w, _ in actions}
    assert "aws_kms_key.main" in where and "data.aws_iam_policy_document.trainer" in where, where  # not vacuous
    wildcards = [(w, a) for w, a in actions if a == "*" or a.endswith(":*")]
    assert not wildcards, wildcards


def _function_timeout_s(body: dict[str, Any]) -> float:
    return float(_resolve(body.get("timeout", 3)))  # 3 s is Lambda's default


def test_lambda_timeouts_stay_below_the_routers_read_timeout() -> None:
    config = RewardConfig()
    functions = _resources("aws_lambda_function")
    assert {"reward", "job_trigger"} <= set(functions)
    for name, body in functions.items():
        assert _function_timeout_s(body) < config.lambda_read_s, (
            f"aws_lambda_function.{name} timeout {_function_timeout_s(body)}s is not below the reward router's "
            f"read timeout {config.lambda_read_s}s: the client would give up on a running handler")
    assert _function_timeout_s(functions["reward"]) == config.timeout_s, "reward_timeout_s != RewardConfig.timeout_s"


def test_one_reward_function_per_registered_reward() -> None:
    reward = _resources("aws_lambda_function")["reward"]
    assert reward["handler"] == "jetroll.functions.lambda_handler.handler"
    assert reward["for_each"] == "${var.reward_names}"
    assert set(_hcl()["variable"]["reward_names"]["default"]) == set(REWARDS) - NOT_ON_LAMBDA
    for body in _resources("aws_lambda_function").values():
        assert _block(body, "tracing_config")["mode"] == "Active"
        assert body.get("reserved_concurrent_executions") is not None
        assert body.get("kms_key_arn") and _block(body, "vpc_config")["subnet_ids"]
        assert _block(body, "dead_letter_config")["target_arn"]


def _role_statements(role: str) -> list[dict[str, Any]]:
    """The statements of every inline policy of aws_iam_role.<role> (from aws_iam_policy_document data blocks)."""
    documents = _hcl()["data"]["aws_iam_policy_document"]
    statements: list[dict[str, Any]] = []
    policies = [p for p in _resources("aws_iam_role_policy").values() if p["role"] == f"${{aws_iam_role.{role}.id}}"]
    assert policies, f"aws_iam_role.{role} has no inline policy"
    pending = [p["policy"] for p in policies]
    while pending:
        ref = re.fullmatch(r"\$\{data\.aws_iam_policy_document\.(\w+)\.json\}", pending.pop())
        assert ref, "policies must come from aws_iam_policy_document data blocks"
        document = documents[ref.group(1)]
        statements += document.get("statement", [])
        pending += document.get("source_policy_documents", [])
    return statements


def _resources_of(statement: dict[str, Any]) -> list[str]:
    resources = statement.get("resources", [])
    return [str(_resolve(r)) for r in (resources if isinstance(resources, list) else [resources])]


def test_trainer_writes_only_under_weights() -> None:
    statements = _role_statements("trainer")
    writes = [s for s in statements if any(a.startswith("s3:") and not a.startswith(S3_READ_ONLY)
                                           for a in s["actions"])]
    assert any("s3:PutObject" in s["actions"] for s in writes)
    for statement in writes:
        for resource in _resources_of(statement):
            assert resource == "${aws_s3_bucket.main.arn}/weights/*", (statement["actions"], resource)
    reads = [r for s in statements if "s3:GetObject" in s["actions"] for r in _resources_of(s)]
    assert sorted(reads) == ["${aws_s3_bucket.main.arn}/jobs/*", "${aws_s3_bucket.main.arn}/weights/*"]


def test_rollout_only_reads_weights() -> None:
    statements = _role_statements("rollout")
    s3_actions = {a for s in statements for a in s["actions"] if a.startswith("s3:")}
    assert s3_actions == {"s3:GetObject", "s3:ListBucket"}
    for statement in statements:
        if "s3:GetObject" in statement["actions"]:
            assert _resources_of(statement) == ["${aws_s3_bucket.main.arn}/weights/*"]


def test_reward_functions_may_only_log() -> None:
    actions = {a for s in _role_statements("reward_lambda") for a in s["actions"]}
    # beyond logs: tracing, VPC network interfaces, the DLQ and the env/queue key that every function needs
    services = {a.split(":")[0] for a in actions}
    assert services <= {"logs", "xray", "ec2", "sqs", "kms"}, services
    assert {a for a in actions if a.startswith(("sqs:", "kms:", "logs:"))} == {
        "sqs:SendMessage", "kms:Decrypt", "kms:GenerateDataKey", "logs:CreateLogStream", "logs:PutLogEvents"}


def test_job_trigger_submits_only_the_one_job_definition_to_the_one_queue() -> None:
    statements = _role_statements("job_trigger")
    batch = [s for s in statements if any(a.startswith("batch:") for a in s["actions"])]
    assert [s["actions"] for s in batch] == [["batch:SubmitJob"]]
    assert sorted(_resources_of(batch[0])) == ["${aws_batch_job_definition.job.arn}", "${aws_batch_job_queue.main.arn}"]
    env = _block(_resources("aws_lambda_function")["job_trigger"], "environment")["variables"]
    assert env == {"JOB_QUEUE": "${aws_batch_job_queue.main.arn}",
                   "JOB_DEFINITION": "${aws_batch_job_definition.job.arn}"}


def test_jobs_prefix_event_reaches_only_job_trigger() -> None:
    (rule_name,) = _resources("aws_cloudwatch_event_rule")
    pattern = _resources("aws_cloudwatch_event_rule")[rule_name]["event_pattern"]
    compact = re.sub(r"\s+", "", pattern)
    assert 'source=["aws.s3"]' in compact and '"detail-type"=["Object Created"]'.replace(" ", "") in compact
    assert "bucket={name=[aws_s3_bucket.main.bucket]}" in compact
    assert 'object={key=[{prefix="jobs/"}]}' in compact
    rule_ref = f"${{aws_cloudwatch_event_rule.{rule_name}"
    targets = [t for t in _resources("aws_cloudwatch_event_target").values() if t["rule"].startswith(rule_ref)]
    assert [t["arn"] for t in targets] == ["${aws_lambda_function.job_trigger.arn}"]
    permissions = [p for p in _resources("aws_lambda_permission").values() if p["principal"] == "events.amazonaws.com"]
    assert [(p["function_name"], p["source_arn"]) for p in permissions] == [
        ("${aws_lambda_function.job_trigger.function_name}", f"{rule_ref}.arn}}")]


def test_batch_job_runs_jetroll_on_a_gpu_from_ecr() -> None:
    (definition,) = _resources("aws_batch_job_definition").values()
    container = re.sub(r"\s+", " ", definition["container_properties"])
    assert 'command = ["jetroll", "run", "Ref::job_uri"]' in container
    assert '{type = "GPU", value = tostring(var.job_gpus)}' in container
    assert "aws_ecr_repository.main[\"job\"].repository_url" in container
    for repo in _resources("aws_ecr_repository").values():
        assert repo["image_tag_mutability"] == "IMMUTABLE"
        assert _block(repo, "image_scanning_configuration")["scan_on_push"] is True
        assert _block(repo, "encryption_configuration")["encryption_type"] == "KMS"


def test_redis_is_encrypted_authenticated_and_private() -> None:
    (redis,) = _resources("aws_elasticache_replication_group").values()
    assert redis["transit_encryption_enabled"] is True and redis["at_rest_encryption_enabled"] is True
    assert redis["auth_token"] == "${var.redis_auth_token}"
    assert _hcl()["variable"]["redis_auth_token"]["sensitive"] is True
    (subnets,) = _resources("aws_elasticache_subnet_group").values()
    assert subnets["subnet_ids"] == "${var.private_subnet_ids}"


# --- the Lambda packages lambda.tf deploys ---

ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
REWARDS_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from jetroll.functions.lambda_handler import handler
import jetroll.functions as functions
calls = [
    {"reward": "arithmetic", "completion": "42", "answer": "42"},
    {"reward": "math", "completion": "so \\\\boxed{0.5}", "answer": "\\\\frac{1}{2}"},
    {"reward": "code", "completion": "def f():\\n    return 1\\n",
     "answer": json.dumps({"asserts": ["assert f() == 1"]})},
]
print(json.dumps({"file": functions.__file__, "torch": "torch" in sys.modules,
                  "results": [handler({**c, "traj_id": "t"}, None) for c in calls]}))
"""
JOB_TRIGGER_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from jetroll.functions import job_trigger
event = {"source": "aws.s3", "detail-type": "Object Created",
         "detail": {"bucket": {"name": "b"}, "object": {"key": "weights/x.bin"}}}
print(json.dumps({"file": job_trigger.__file__, "result": job_trigger.handler(event, None)}))
"""


def _build_zips(out: Path) -> dict[str, Path]:
    result = _run([sys.executable, "scripts/build_lambda_zips.py", "--out", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    return {"rewards": out / "rewards.zip", "job_trigger": out / "job_trigger.zip"}


def _probe(code: str, package_dir: Path, *, no_site: bool) -> dict[str, Any]:
    flags = ["-I", "-S"] if no_site else ["-I"]
    result = subprocess.run([sys.executable, *flags, "-c", code, str(package_dir)], cwd=package_dir,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_lambda_zips_are_deterministic_self_contained_and_torch_free(tmp_path: Path) -> None:
    first, second = _build_zips(tmp_path / "a"), _build_zips(tmp_path / "b")
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes(), f"{name}.zip is not deterministic"
    with zipfile.ZipFile(first["job_trigger"]) as zf:
        assert sorted(zf.namelist()) == ["jetroll/functions/__init__.py", "jetroll/functions/job_trigger.py"]
    with zipfile.ZipFile(first["rewards"]) as zf:
        names = zf.namelist()
        assert all(info.date_time == ZIP_EPOCH for info in zf.infolist())
        zf.extractall(tmp_path / "rewards")
    tops = {n.split("/")[0] for n in names}
    assert {"jetroll", "msgspec", "math_verify", "sympy"} <= tops
    assert not tops & {"torch", "numpy", "celery", "redis", "boto3"}, tops
    assert {n.split("/")[1] for n in names if n.startswith("jetroll/")} == {"functions"}  # no shared/, no services/
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]
    assert not {f"jetroll/functions/{m}.py" for m in ("celery_app", "job_trigger")} & set(names)

    # like Lambda: the package unpacked on its own, no site-packages (-S), so every import must come from the zip
    probe = _probe(REWARDS_PROBE, tmp_path / "rewards", no_site=True)
    assert probe["file"].startswith(str(tmp_path / "rewards")) and probe["torch"] is False
    assert [r["reward"] for r in probe["results"]] == [1.0, 1.0, 1.0], probe["results"]

    with zipfile.ZipFile(first["job_trigger"]) as zf:
        zf.extractall(tmp_path / "job_trigger")
    probe = _probe(JOB_TRIGGER_PROBE, tmp_path / "job_trigger", no_site=False)  # boto3 comes with the runtime
    assert probe["file"].startswith(str(tmp_path / "job_trigger"))
    assert probe["result"]["submitted"] is False


def test_terraform_deploys_the_zips_the_script_builds() -> None:
    variables = _hcl()["variable"]
    for name in ("rewards", "job_trigger"):
        assert (INFRA / variables[f"{name}_zip"]["default"]).resolve() == ROOT / "build" / "lambda" / f"{name}.zip"
    assert variables["lambda_runtime"]["default"] == "python3.11"  # the Python the zips vendor msgspec for
