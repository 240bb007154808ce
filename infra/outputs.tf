output "bucket" {
  description = "S3 bucket: `jetroll submit job.yaml --to s3` uploads under jobs/; set store.uri to s3://<bucket>/weights."
  value       = aws_s3_bucket.main.bucket
}

output "jobs_uri" {
  description = "Where job files go; each upload starts one Batch job."
  value       = "s3://${aws_s3_bucket.main.bucket}/jobs/"
}

output "weights_uri" {
  description = "store.uri for jobs on this stack (the trainer may write only under it)."
  value       = "s3://${aws_s3_bucket.main.bucket}/weights"
}

output "kms_key_arn" {
  description = "Customer managed key of the bucket, Redis, logs, the DLQ and ECR."
  value       = aws_kms_key.main.arn
}

output "redis_primary_endpoint" {
  description = "ElastiCache primary endpoint (TLS, port 6379); the full URL with AUTH is the SSM parameter redis_url_parameter."
  value       = aws_elasticache_replication_group.redis.primary_endpoint_address
}

output "redis_url_parameter" {
  description = "SSM SecureString holding the rediss:// URL; the Batch job receives it as JETROLL_REDIS_URL."
  value       = aws_ssm_parameter.redis_url.name
}

output "reward_lambda_functions" {
  description = "Reward name -> Lambda function name: use as reward.lambda_functions in a job config."
  value       = { for name, fn in aws_lambda_function.reward : name => fn.function_name }
}

output "job_trigger_function" {
  description = "The Lambda that turns a jobs/ upload into a Batch job."
  value       = aws_lambda_function.job_trigger.function_name
}

output "batch_job_queue" {
  description = "ARN of the GPU job queue."
  value       = aws_batch_job_queue.main.arn
}

output "batch_job_definition" {
  description = "ARN (with revision) of the jetroll job definition."
  value       = aws_batch_job_definition.job.arn
}

output "ecr_repositories" {
  description = "Image repositories: job (controller + trainer on Batch) and rollout."
  value       = { for name, repo in aws_ecr_repository.main : name => repo.repository_url }
}

output "dead_letter_queue" {
  description = "SQS queue of failed asynchronous Lambda invocations and undeliverable job events."
  value       = aws_sqs_queue.dlq.url
}
