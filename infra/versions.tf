terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.60" # compute_environment_order, aws_vpc_security_group_*_rule
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ Project = "jetroll", ManagedBy = "terraform" }, var.tags)
  }
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

locals {
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  bucket     = coalesce(var.bucket_name, "${var.name_prefix}-${local.account_id}-${var.region}")
}
