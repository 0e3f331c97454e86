# A fresh machine needs only `make demo` and `make test`; both create the virtualenv when missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zero_bench-installed

.PHONY: demo example test test-fast doctor report clean

# The CPU install path: requirements-cpu.txt pins torch==2.13.0 (a CPU wheel; unpinned, pip would
# pull a multi-GB CUDA build). DeepSpeed's CPU shared-memory collective is JIT-compiled at first
# use (~35 s): build it here once so that trials and tests do not pay for it, with the venv's ninja,
# which the ranks use too (trial/launcher.py trial_env; the system's ninja would not read its build log).
# NVMe offload (offload_device=nvme) needs DeepSpeed's async_io op, built against libaio's headers:
# installed with apt where this runs as root (CI), then the op built too; elsewhere `zero_bench doctor`
# names the command, and nvme runs are refused (their tests skip) until it has run.
$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	-test -e /usr/include/libaio.h || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get update -qq || true; } && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null; }
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	PATH=$(abspath $(VENV))/bin:$$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	-test -e /usr/include/libaio.h && PATH=$(abspath $(VENV))/bin:$$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('AsyncIOBuilder').load()" >/dev/null
	touch $(STAMP)

# The main job on CPU: a real max-batch search per ZeRO stage (conf/sweep/cpu_demo.yaml), then
# reports/demo.{xlsx,csv,md} and the .md's charts. Finished searches are kept in results/demo.sqlite:
# a second `make demo` only writes the report (`make clean` starts over).
demo: $(STAMP)
	$(PY) -m zero_bench maxbatch +sweep=cpu_demo
	$(PY) -m zero_bench report store=results/demo.sqlite report.out=reports/demo.xlsx

# The example a reader of the repository sees (reports/example/, committed): the demo measured afresh.
example: $(STAMP)
	rm -f results/demo.sqlite
	$(MAKE) demo
	rm -rf reports/example && mkdir -p reports/example
	$(PY) -m zero_bench report store=results/demo.sqlite report.out=reports/example/demo.xlsx

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

doctor: $(STAMP)
	$(PY) -m zero_bench doctor

report: $(STAMP)
	$(PY) -m zero_bench report

clean:
	rm -rf runs results reports/*.xlsx reports/*.csv reports/*.md reports/*.png
