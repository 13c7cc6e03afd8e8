"""The stage-model step: a Hugging Face model folder from S3 onto the shared volume."""
