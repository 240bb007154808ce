# S3 jobs/ object created -> EventBridge rule -> job_trigger (its only target) -> batch:SubmitJob.

locals {
  job_rule_name = "${var.name_prefix}-job-created"
}

resource "aws_cloudwatch_event_rule" "job_created" {
  name        = local.job_rule_name
  description = "A job file was uploaded under s3://${local.bucket}/jobs/"
  event_pattern = jsonencode({
    source        = ["aws.s3"]
    "detail-type" = ["Object Created"]
    detail = {
      bucket = { name = [aws_s3_bucket.main.bucket] }
      object = { key = [{ prefix = "jobs/" }] }
    }
  })
}

resource "aws_cloudwatch_event_target" "job_trigger" {
  rule      = aws_cloudwatch_event_rule.job_created.name
  target_id = "job-trigger"
  arn       = aws_lambda_function.job_trigger.arn

  retry_policy {
    maximum_event_age_in_seconds = 3600
    maximum_retry_attempts       = 20
  }

  dead_letter_config {
    arn = aws_sqs_queue.dlq.arn
  }
}

resource "aws_lambda_permission" "job_trigger_from_rule" {
  statement_id  = "AllowJobCreatedRule"
  action        = "lambda:InvokeFunction"
  function_name = aws_lambda_function.job_trigger.function_name
  principal     = "events.amazonaws.com"
  source_arn    = aws_cloudwatch_event_rule.job_created.arn
}

# EventBridge may drop undeliverable events into the DLQ, for this rule only.
resource "aws_sqs_queue_policy" "dlq" {
  queue_url = aws_sqs_queue.dlq.id
  policy    = data.aws_iam_policy_document.dlq.json
}

data "aws_iam_policy_document" "dlq" {
  statement {
    sid       = "JobRuleDeadLetters"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.dlq.arn]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_cloudwatch_event_rule.job_created.arn]
    }
  }
}
