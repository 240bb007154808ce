# The reward functions (one per reward, all running jetroll.functions.lambda_handler.handler) and job_trigger, from the
# zips scripts/build_lambda_zips.py builds. All in the private subnets, traced, with reserved concurrency, a
# dead-letter queue for asynchronous invocations, KMS-encrypted environment and code-signing validation.

resource "aws_signer_signing_profile" "lambda" {
  name_prefix = replace("${var.name_prefix}_lambda_", "-", "_")
  platform_id = "AWSLambda-SHA384-ECDSA"
}

resource "aws_lambda_code_signing_config" "main" {
  description = "${var.name_prefix}: packages signed by the jetroll signing profile"

  allowed_publishers {
    signing_profile_version_arns = [aws_signer_signing_profile.lambda.version_arn]
  }

  policies {
    untrusted_artifact_on_deployment = var.lambda_code_signing_policy
  }
}

resource "aws_sqs_queue" "dlq" {
  name                      = "${var.name_prefix}-lambda-dlq"
  kms_master_key_id         = aws_kms_key.main.arn
  message_retention_seconds = 1209600
}

resource "aws_cloudwatch_log_group" "reward" {
  for_each          = var.reward_names
  name              = "/aws/lambda/${var.name_prefix}-reward-${each.key}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.main.arn
}

resource "aws_lambda_function" "reward" {
  for_each                       = var.reward_names
  function_name                  = "${var.name_prefix}-reward-${each.key}"
  description                    = "jetroll reward ${each.key} (event: reward, completion, answer, traj_id)"
  role                           = aws_iam_role.reward_lambda.arn
  runtime                        = var.lambda_runtime
  handler                        = "jetroll.functions.lambda_handler.handler"
  filename                       = var.rewards_zip
  source_code_hash               = filebase64sha256(var.rewards_zip)
  timeout                        = var.reward_timeout_s
  memory_size                    = var.reward_memory_mb
  reserved_concurrent_executions = var.reward_reserved_concurrency
  kms_key_arn                    = aws_kms_key.main.arn
  code_signing_config_arn        = aws_lambda_code_signing_config.main.arn

  tracing_config {
    mode = "Active"
  }

  vpc_config {
    subnet_ids         = var.private_subnet_ids
    security_group_ids = [aws_security_group.reward_lambda.id]
  }

  dead_letter_config {
    target_arn = aws_sqs_queue.dlq.arn
  }

  dynamic "environment" {
    for_each = length(var.reward_modules) > 0 ? [1] : []

    content {
      variables = { JETROLL_REWARD_MODULES = join(",", var.reward_modules) }
    }
  }

  depends_on = [aws_cloudwatch_log_group.reward, aws_iam_role_policy.reward_lambda]
}

resource "aws_cloudwatch_log_group" "job_trigger" {
  name              = "/aws/lambda/${var.name_prefix}-job-trigger"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.main.arn
}

resource "aws_lambda_function" "job_trigger" {
  function_name                  = "${var.name_prefix}-job-trigger"
  description                    = "S3 jobs/ object created (EventBridge) -> batch:SubmitJob"
  role                           = aws_iam_role.job_trigger.arn
  runtime                        = var.lambda_runtime
  handler                        = "jetroll.functions.job_trigger.handler"
  filename                       = var.job_trigger_zip
  source_code_hash               = filebase64sha256(var.job_trigger_zip)
  timeout                        = var.job_trigger_timeout_s
  memory_size                    = 256
  reserved_concurrent_executions = var.job_trigger_reserved_concurrency
  kms_key_arn                    = aws_kms_key.main.arn
  code_signing_config_arn        = aws_lambda_code_signing_config.main.arn

  tracing_config {
    mode = "Active"
  }

  vpc_config {
    subnet_ids         = var.private_subnet_ids
    security_group_ids = [aws_security_group.job_trigger.id]
  }

  dead_letter_config {
    target_arn = aws_sqs_queue.dlq.arn
  }

  environment {
    variables = {
      JOB_QUEUE      = aws_batch_job_queue.main.arn
      JOB_DEFINITION = aws_batch_job_definition.job.arn
    }
  }

  depends_on = [aws_cloudwatch_log_group.job_trigger, aws_iam_role_policy.job_trigger]
}
