# AWS Batch: a managed EC2 GPU compute environment (scales to zero), one job queue, and the job definition that
# runs `jetroll run <job_uri>` (controller and trainer) in the <name_prefix>/job image.

resource "aws_launch_template" "batch" {
  name                   = "${var.name_prefix}-batch-gpu"
  description            = "Batch GPU instances: IMDSv2 only, encrypted root volume"
  update_default_version = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"

    ebs {
      volume_size           = var.batch_root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
}

resource "aws_batch_compute_environment" "gpu" {
  compute_environment_name_prefix = "${var.name_prefix}-gpu-"
  type                            = "MANAGED"
  state                           = "ENABLED"

  compute_resources {
    type                = "EC2"
    allocation_strategy = "BEST_FIT_PROGRESSIVE"
    instance_type       = var.gpu_instance_types
    min_vcpus           = 0
    max_vcpus           = var.batch_max_vcpus
    subnets             = var.private_subnet_ids
    security_group_ids  = [aws_security_group.batch.id]
    instance_role       = aws_iam_instance_profile.batch_instance.arn

    ec2_configuration {
      image_type = var.batch_image_type
    }

    launch_template {
      launch_template_id = aws_launch_template.batch.id
      version            = aws_launch_template.batch.latest_version
    }
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_batch_job_queue" "main" {
  name     = "${var.name_prefix}-gpu"
  state    = "ENABLED"
  priority = 1

  compute_environment_order {
    order               = 1
    compute_environment = aws_batch_compute_environment.gpu.arn
  }
}

resource "aws_cloudwatch_log_group" "batch" {
  name              = "/aws/batch/${var.name_prefix}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.main.arn
}

resource "aws_batch_job_definition" "job" {
  name                  = "${var.name_prefix}-job"
  type                  = "container"
  platform_capabilities = ["EC2"]
  propagate_tags        = true

  retry_strategy {
    attempts = var.job_attempts
  }

  timeout {
    attempt_duration_seconds = var.job_timeout_s
  }

  container_properties = jsonencode({
    image            = "${aws_ecr_repository.main["job"].repository_url}:${var.image_tag}"
    command          = ["jetroll", "run", "Ref::job_uri"]
    jobRoleArn       = aws_iam_role.trainer.arn
    executionRoleArn = aws_iam_role.batch_execution.arn
    privileged       = false
    resourceRequirements = [
      { type = "GPU", value = tostring(var.job_gpus) },
      { type = "VCPU", value = tostring(var.job_vcpus) },
      { type = "MEMORY", value = tostring(var.job_memory_mib) },
    ]
    linuxParameters = {
      sharedMemorySize   = var.job_shared_memory_mib
      initProcessEnabled = true
    }
    environment = [
      { name = "AWS_DEFAULT_REGION", value = var.region },
      { name = "JETROLL_BUCKET", value = aws_s3_bucket.main.bucket },
      { name = "JETROLL_WEIGHTS_URI", value = "s3://${aws_s3_bucket.main.bucket}/weights" },
    ]
    secrets = [
      { name = "JETROLL_REDIS_URL", valueFrom = aws_ssm_parameter.redis_url.arn },
    ]
    logConfiguration = {
      logDriver = "awslogs"
      options = {
        awslogs-group         = aws_cloudwatch_log_group.batch.name
        awslogs-region        = var.region
        awslogs-stream-prefix = "job"
      }
    }
  })
}
