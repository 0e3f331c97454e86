# A fresh machine needs only `make demo` and `make test`; both create the virtualenv when missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zero_bench-installed

.PHONY: demo test test-fast doctor report clean

# The CPU install path: requirements-cpu.txt pins torch==2.13.0 (a CPU wheel; unpinned, pip would
# pull a multi-GB CUDA build). DeepSpeed's CPU shared-memory collective is JIT-compiled at first
# use (~35 s): build it here once so that trials and tests do not pay for it.
$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	touch $(STAMP)

# The main job on the CPU default: a real max-batch search over ZeRO 0-3 x offload, then the report.
demo: $(STAMP)
	$(PY) -m zero_bench maxbatch +sweep=cpu_demo
	$(PY) -m zero_bench report

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

doctor: $(STAMP)
	$(PY) -m zero_bench doctor

report: $(STAMP)
	$(PY) -m zero_bench report

clean:
	rm -rf runs results reports/*.xlsx reports/*.csv reports/*.md
