# The MLflow server image deploy/eks/mlflow.yaml runs: the stock image plus MLflow's `auth`
# extra (Flask-WTF, which `--app-name basic-auth` imports), the PostgreSQL driver psycopg2
# (the URIs say postgresql+psycopg2://: a bare postgresql:// selects psycopg 3 under
# SQLAlchemy 2.1) and boto3, installed at build time (a server that pip-installs at start
# depends on PyPI being reachable from the cluster and can come up with other versions).
#   docker build -f deploy/eks/mlflow.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/rtp-mlflow:3.17.2 .
FROM ghcr.io/mlflow/mlflow:v3.17.2
RUN pip install --no-cache-dir "mlflow[auth]==3.17.2" psycopg2-binary==2.9.10 boto3==1.44.8 \
 && useradd --create-home --uid 1000 mlflow
USER 1000
