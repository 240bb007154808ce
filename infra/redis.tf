# ElastiCache Redis OSS for the Redis Streams bus: TLS in transit, KMS at rest, AUTH, Multi-AZ failover.
resource "aws_elasticache_subnet_group" "redis" {
  name        = "${var.name_prefix}-redis"
  description = "Private subnets of the jetroll Redis replication group"
  subnet_ids  = var.private_subnet_ids
}

resource "aws_elasticache_replication_group" "redis" {
  replication_group_id       = "${var.name_prefix}-redis"
  description                = "jetroll Redis Streams bus"
  engine                     = "redis"
  engine_version             = var.redis_engine_version
  node_type                  = var.redis_node_type
  num_cache_clusters         = var.redis_num_cache_clusters
  port                       = 6379
  subnet_group_name          = aws_elasticache_subnet_group.redis.name
  security_group_ids         = [aws_security_group.redis.id]
  automatic_failover_enabled = true
  multi_az_enabled           = true
  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.main.arn
  transit_encryption_enabled = true
  auth_token                 = var.redis_auth_token
  auto_minor_version_upgrade = true
  snapshot_retention_limit   = var.redis_snapshot_retention_days
  apply_immediately          = false

  log_delivery_configuration {
    destination      = aws_cloudwatch_log_group.redis_slow.name
    destination_type = "cloudwatch-logs"
    log_format       = "json"
    log_type         = "slow-log"
  }
}

resource "aws_cloudwatch_log_group" "redis_slow" {
  name              = "/aws/elasticache/${var.name_prefix}-redis/slow-log"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.main.arn
}

# The job's redis.url, AUTH token included, as a SecureString the Batch job receives as JETROLL_REDIS_URL.
resource "aws_ssm_parameter" "redis_url" {
  name        = "/${var.name_prefix}/redis-url"
  description = "rediss:// URL (with AUTH token) of the jetroll Redis replication group"
  type        = "SecureString"
  key_id      = aws_kms_key.main.arn
  value       = "rediss://:${urlencode(var.redis_auth_token)}@${aws_elasticache_replication_group.redis.primary_endpoint_address}:${aws_elasticache_replication_group.redis.port}/0"
}
