# The MLflow server image deploy/eks/mlflow.yaml runs: the stock image plus the PostgreSQL
# driver and boto3, installed at build time (a server that pip-installs at start depends
# on PyPI being reachable from the cluster and can come up with other versions).
#   docker build -f deploy/eks/mlflow.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/rtp-mlflow:3.17.2 .
FROM ghcr.io/mlflow/mlflow:v3.17.2
RUN pip install --no-cache-dir psycopg2-binary==2.9.10 boto3==1.44.8 \
 && useradd --create-home --uid 1000 mlflow
USER 1000
