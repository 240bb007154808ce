# Least-privilege roles. Every statement names its actions; S3 writes are confined to weights/*.

locals {
  bucket_arn          = aws_s3_bucket.main.arn
  weights_objects_arn = "${aws_s3_bucket.main.arn}/weights/*"
  jobs_objects_arn    = "${aws_s3_bucket.main.arn}/jobs/*"
  ec2_arn_prefix      = "arn:${local.partition}:ec2:${var.region}:${local.account_id}"
}

data "aws_iam_policy_document" "assume_ecs_tasks" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ecs-tasks.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

data "aws_iam_policy_document" "assume_lambda" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# --- trainer: the Batch job's role (controller, trainer, rollout and reward router in one job) ---

resource "aws_iam_role" "trainer" {
  name               = "${var.name_prefix}-trainer"
  description        = "Batch job role: reads jobs/ and weights/, writes weights/ only, invokes the reward functions"
  assume_role_policy = data.aws_iam_policy_document.assume_ecs_tasks.json
}

data "aws_iam_policy_document" "trainer" {
  statement {
    sid       = "ReadJobsAndWeights"
    actions   = ["s3:GetObject"]
    resources = [local.jobs_objects_arn, local.weights_objects_arn]
  }

  statement {
    sid       = "WriteWeightsOnly"
    actions   = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = [local.weights_objects_arn]
  }

  statement {
    sid       = "ListJobsAndWeights"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["jobs/*", "weights/*"]
    }
  }

  statement {
    sid       = "UseTheBucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.main.arn]
  }

  statement {
    sid       = "InvokeRewardFunctions"
    actions   = ["lambda:InvokeFunction"]
    resources = [for fn in aws_lambda_function.reward : fn.arn]
  }
}

resource "aws_iam_role_policy" "trainer" {
  name   = "trainer"
  role   = aws_iam_role.trainer.id
  policy = data.aws_iam_policy_document.trainer.json
}

# --- rollout: rollout pools outside the Batch job (ECS tasks) read published weights only ---

resource "aws_iam_role" "rollout" {
  name               = "${var.name_prefix}-rollout"
  description        = "Rollout pools: read weights/ only"
  assume_role_policy = data.aws_iam_policy_document.assume_ecs_tasks.json
}

data "aws_iam_policy_document" "rollout" {
  statement {
    sid       = "ReadWeights"
    actions   = ["s3:GetObject"]
    resources = [local.weights_objects_arn]
  }

  statement {
    sid       = "ListWeights"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["weights/*"]
    }
  }

  statement {
    sid       = "DecryptWeights"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.main.arn]
  }
}

resource "aws_iam_role_policy" "rollout" {
  name   = "rollout"
  role   = aws_iam_role.rollout.id
  policy = data.aws_iam_policy_document.rollout.json
}

# --- Batch: the execution role (pull the image, write logs, read the Redis URL) and the instance role ---

resource "aws_iam_role" "batch_execution" {
  name               = "${var.name_prefix}-batch-execution"
  description        = "Batch job execution: pull the job image, write the job log, read the Redis URL parameter"
  assume_role_policy = data.aws_iam_policy_document.assume_ecs_tasks.json
}

data "aws_iam_policy_document" "batch_execution" {
  statement {
    sid       = "EcrLogin"
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"] # GetAuthorizationToken has no resource type
  }

  statement {
    sid       = "PullJobImage"
    actions   = ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
    resources = [aws_ecr_repository.main["job"].arn]
  }

  statement {
    sid       = "WriteJobLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.batch.arn}:*"]
  }

  statement {
    sid       = "ReadRedisUrl"
    actions   = ["ssm:GetParameters"]
    resources = [aws_ssm_parameter.redis_url.arn]
  }

  statement {
    sid       = "DecryptRedisUrl"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.main.arn]
  }
}

resource "aws_iam_role_policy" "batch_execution" {
  name   = "batch-execution"
  role   = aws_iam_role.batch_execution.id
  policy = data.aws_iam_policy_document.batch_execution.json
}

resource "aws_iam_role" "batch_instance" {
  name               = "${var.name_prefix}-batch-instance"
  description        = "ECS container instances of the Batch GPU compute environment"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json
}

resource "aws_iam_role_policy_attachment" "batch_instance" {
  role       = aws_iam_role.batch_instance.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"
}

resource "aws_iam_instance_profile" "batch_instance" {
  name = "${var.name_prefix}-batch-instance"
  role = aws_iam_role.batch_instance.name
}

# --- Lambda: what every function needs (its own logs, X-Ray, VPC network interfaces, the DLQ, the key) ---

data "aws_iam_policy_document" "lambda_base" {
  statement {
    sid       = "Tracing"
    actions   = ["xray:PutTraceSegments", "xray:PutTelemetryRecords"]
    resources = ["*"] # X-Ray actions have no resource type
  }

  statement {
    sid       = "DescribeNetwork"
    actions   = ["ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets"]
    resources = ["*"] # Describe actions have no resource type
  }

  statement {
    sid     = "VpcNetworkInterfaces"
    actions = ["ec2:CreateNetworkInterface"]
    resources = concat(
      ["${local.ec2_arn_prefix}:network-interface/*"],
      [for id in var.private_subnet_ids : "${local.ec2_arn_prefix}:subnet/${id}"],
      [
        "${local.ec2_arn_prefix}:security-group/${aws_security_group.reward_lambda.id}",
        "${local.ec2_arn_prefix}:security-group/${aws_security_group.job_trigger.id}",
      ],
    )
  }

  statement {
    sid       = "ManageOwnNetworkInterfaces"
    actions   = ["ec2:DeleteNetworkInterface", "ec2:AssignPrivateIpAddresses", "ec2:UnassignPrivateIpAddresses"]
    resources = ["${local.ec2_arn_prefix}:network-interface/*"]
  }

  statement {
    sid       = "DeadLetterQueue"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.dlq.arn]
  }

  statement {
    sid       = "EnvironmentAndQueueKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.main.arn]
  }
}

# --- reward functions: logs only (plus the Lambda base) ---

resource "aws_iam_role" "reward_lambda" {
  name               = "${var.name_prefix}-reward-lambda"
  description        = "Reward Lambda functions: write their own logs, nothing else"
  assume_role_policy = data.aws_iam_policy_document.assume_lambda.json
}

data "aws_iam_policy_document" "reward_lambda" {
  source_policy_documents = [data.aws_iam_policy_document.lambda_base.json]

  statement {
    sid       = "WriteOwnLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = [for group in aws_cloudwatch_log_group.reward : "${group.arn}:*"]
  }
}

resource "aws_iam_role_policy" "reward_lambda" {
  name   = "reward-lambda"
  role   = aws_iam_role.reward_lambda.id
  policy = data.aws_iam_policy_document.reward_lambda.json
}

# --- job_trigger: batch:SubmitJob on the one queue and the one job definition ---

resource "aws_iam_role" "job_trigger" {
  name               = "${var.name_prefix}-job-trigger"
  description        = "job_trigger Lambda: submit the jetroll job definition to the jetroll queue"
  assume_role_policy = data.aws_iam_policy_document.assume_lambda.json
}

data "aws_iam_policy_document" "job_trigger" {
  source_policy_documents = [data.aws_iam_policy_document.lambda_base.json]

  statement {
    sid       = "SubmitJetrollJob"
    actions   = ["batch:SubmitJob"]
    resources = [aws_batch_job_queue.main.arn, aws_batch_job_definition.job.arn]
  }

  statement {
    sid       = "WriteOwnLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.job_trigger.arn}:*"]
  }
}

resource "aws_iam_role_policy" "job_trigger" {
  name   = "job-trigger"
  role   = aws_iam_role.job_trigger.id
  policy = data.aws_iam_policy_document.job_trigger.json
}
