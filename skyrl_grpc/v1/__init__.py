"""Generated from protos/skyrl/inference/v1 by buf generate; do not edit."""
