variable "region" {
  description = "AWS region for every resource."
  type        = string
  default     = "us-east-1"
}

variable "name_prefix" {
  description = "Prefix of every resource name (functions, queue, roles, repositories)."
  type        = string
  default     = "jetroll"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name_prefix))
    error_message = "name_prefix must be 2-31 lowercase letters, digits or '-', starting with a letter."
  }
}

variable "tags" {
  description = "Extra tags on every resource."
  type        = map(string)
  default     = {}
}

variable "bucket_name" {
  description = "S3 bucket for weights/ and jobs/; null means <name_prefix>-<account id>-<region>."
  type        = string
  default     = null
}

variable "vpc_id" {
  description = "VPC of the private subnets (Redis, the Batch GPU instances and the Lambda functions live there)."
  type        = string
}

variable "private_subnet_ids" {
  description = "Private subnets in at least two availability zones; they need a NAT gateway or VPC endpoints (ECR, S3, Batch, CloudWatch Logs) for the Batch instances and job_trigger."
  type        = list(string)

  validation {
    condition     = length(var.private_subnet_ids) >= 2
    error_message = "private_subnet_ids needs at least two subnets (Multi-AZ Redis failover)."
  }
}

variable "kms_deletion_window_days" {
  description = "Waiting period before the customer managed key is deleted."
  type        = number
  default     = 30
}

variable "log_retention_days" {
  description = "Retention of every CloudWatch log group (Lambda functions, Batch jobs, Redis slow log)."
  type        = number
  default     = 365

  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch retention value of at least one year (365, 400, 545, 731, ...)."
  }
}

# --- S3 ---

variable "noncurrent_version_expiration_days" {
  description = "Days after which overwritten or deleted object versions (old weights, old jobs) are expired."
  type        = number
  default     = 30
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (an interrupted weight upload) are aborted."
  type        = number
  default     = 2
}

# --- Redis ---

variable "redis_auth_token" {
  description = "Redis AUTH token (16-128 characters, URL-safe so it can sit in a rediss:// URL)."
  type        = string
  sensitive   = true

  validation {
    condition     = can(regex("^[A-Za-z0-9._~-]{16,128}$", var.redis_auth_token))
    error_message = "redis_auth_token must be 16-128 characters from A-Z a-z 0-9 . _ ~ -."
  }
}

variable "redis_engine_version" {
  description = "ElastiCache Redis OSS engine version (Redis Streams with XAUTOCLAIM need 6.2 or later)."
  type        = string
  default     = "7.1"
}

variable "redis_node_type" {
  description = "ElastiCache node type."
  type        = string
  default     = "cache.r7g.large"
}

variable "redis_num_cache_clusters" {
  description = "Nodes in the replication group: a primary plus replicas (at least 2 for Multi-AZ failover)."
  type        = number
  default     = 2

  validation {
    condition     = var.redis_num_cache_clusters >= 2
    error_message = "redis_num_cache_clusters must be at least 2 for automatic failover."
  }
}

variable "redis_snapshot_retention_days" {
  description = "Days of automatic Redis snapshots."
  type        = number
  default     = 7
}

# --- Lambda ---

variable "lambda_runtime" {
  description = "Lambda runtime; must match the Python that ran scripts/build_lambda_zips.py (the zip vendors compiled msgspec)."
  type        = string
  default     = "python3.11"
}

variable "rewards_zip" {
  description = "Reward functions package built by scripts/build_lambda_zips.py (path relative to the directory terraform runs in)."
  type        = string
  default     = "../build/lambda/rewards.zip"
}

variable "job_trigger_zip" {
  description = "job_trigger package built by scripts/build_lambda_zips.py (path relative to the directory terraform runs in)."
  type        = string
  default     = "../build/lambda/job_trigger.zip"
}

variable "reward_names" {
  description = "Rewards deployed as one Lambda function each (functions/builtin.py); the handler runs event.reward."
  type        = set(string)
  default     = ["arithmetic", "calculator", "count", "math", "code", "exact_match", "token_f1", "format", "length"]
}

variable "reward_timeout_s" {
  description = "Reward function timeout; keep it equal to the jobs' reward.timeout_s, below the router's read timeout reward.lambda_read_s (timeout_s + 10 by default)."
  type        = number
  default     = 10

  validation {
    condition     = var.reward_timeout_s >= 1 && var.reward_timeout_s <= 900
    error_message = "reward_timeout_s must be within Lambda's 1-900 s."
  }
}

variable "reward_memory_mb" {
  description = "Memory of each reward function (CPU scales with it; math imports sympy, code runs a subprocess)."
  type        = number
  default     = 1024
}

variable "reward_reserved_concurrency" {
  description = "Reserved concurrency of each reward function; the default equals reward.lambda_concurrency, the router's invocations in flight. The account needs 100 unreserved on top of the sum."
  type        = number
  default     = 32
}

variable "reward_modules" {
  description = "Extra modules with @reward functions, imported at cold start (JETROLL_REWARD_MODULES); they must be inside the zip."
  type        = list(string)
  default     = []
}

variable "job_trigger_timeout_s" {
  description = "job_trigger timeout: one batch:SubmitJob call."
  type        = number
  default     = 15
}

variable "job_trigger_reserved_concurrency" {
  description = "Reserved concurrency of job_trigger."
  type        = number
  default     = 2
}

variable "lambda_code_signing_policy" {
  description = "What Lambda does with a package that is not signed by the signing profile: Warn (deploy, log a warning) or Enforce (reject). Enforce needs packages signed with AWS Signer (see README)."
  type        = string
  default     = "Warn"

  validation {
    condition     = contains(["Warn", "Enforce"], var.lambda_code_signing_policy)
    error_message = "lambda_code_signing_policy must be Warn or Enforce."
  }
}

# --- Batch and ECR ---

variable "image_tag" {
  description = "Tag of the job image in the <name_prefix>/job ECR repository (tags are immutable: push a new tag per release)."
  type        = string
  default     = "0.1.0"
}

variable "gpu_instance_types" {
  description = "GPU instance types of the Batch compute environment; FP8 needs Ada or Hopper GPUs (g6, g6e, p5)."
  type        = list(string)
  default     = ["g6e.2xlarge"]
}

variable "batch_max_vcpus" {
  description = "Maximum vCPUs of the Batch compute environment (0 minimum: no idle GPU instances)."
  type        = number
  default     = 64
}

variable "batch_image_type" {
  description = "ECS-optimised AMI family of the compute environment; the NVIDIA one carries the GPU driver."
  type        = string
  default     = "ECS_AL2023_NVIDIA"
}

variable "batch_root_volume_gb" {
  description = "Root EBS volume of each GPU instance (the job image with torch and CUDA is large)."
  type        = number
  default     = 200
}

variable "job_gpus" {
  description = "GPUs per job."
  type        = number
  default     = 1
}

variable "job_vcpus" {
  description = "vCPUs per job."
  type        = number
  default     = 8
}

variable "job_memory_mib" {
  description = "Memory per job in MiB (below the instance's memory minus the ECS agent's share)."
  type        = number
  default     = 60000
}

variable "job_shared_memory_mib" {
  description = "/dev/shm size in MiB (torch and the rollout workers share tensors through it)."
  type        = number
  default     = 8192
}

variable "job_timeout_s" {
  description = "Batch kills a job attempt that runs longer than this."
  type        = number
  default     = 86400
}

variable "job_attempts" {
  description = "Attempts per job (a restarted job resumes from its last checkpoint in the bucket)."
  type        = number
  default     = 1
}
