# Security groups in the given VPC. Nothing here accepts traffic from outside the VPC.

resource "aws_security_group" "batch" {
  name        = "${var.name_prefix}-batch"
  description = "Batch GPU instances running jetroll jobs"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_egress_rule" "batch_https" {
  security_group_id = aws_security_group.batch.id
  description       = "HTTPS to AWS APIs (ECR, S3, Batch, CloudWatch Logs, Lambda) through NAT or VPC endpoints"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "batch_redis" {
  security_group_id            = aws_security_group.batch.id
  description                  = "Redis (TLS) on ElastiCache"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = aws_security_group.redis.id
}

resource "aws_security_group" "redis" {
  name        = "${var.name_prefix}-redis"
  description = "ElastiCache Redis: reachable only from the Batch jobs"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_ingress_rule" "redis_from_batch" {
  security_group_id            = aws_security_group.redis.id
  description                  = "Redis (TLS) from the Batch jobs"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = aws_security_group.batch.id
}

# No rules: reward functions run model-written code (the code reward), which must not reach any network.
resource "aws_security_group" "reward_lambda" {
  name        = "${var.name_prefix}-reward-lambda"
  description = "Reward Lambda functions: no ingress and no egress"
  vpc_id      = var.vpc_id
}

resource "aws_security_group" "job_trigger" {
  name        = "${var.name_prefix}-job-trigger"
  description = "job_trigger Lambda: HTTPS to the Batch API only"
  vpc_id      = var.vpc_id
}

resource "aws_vpc_security_group_egress_rule" "job_trigger_https" {
  security_group_id = aws_security_group.job_trigger.id
  description       = "HTTPS to the Batch API through NAT or a Batch VPC endpoint"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}
