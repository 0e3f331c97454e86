# A fresh machine needs only `make demo` and `make test`; both create the virtualenv when missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zero_bench-installed
AIO    := $(VENV)/.async_io-built

.PHONY: demo example test test-fast doctor report clean

# The CPU install path: requirements-cpu.txt pins torch==2.13.0 (a CPU wheel; unpinned, pip would
# pull a multi-GB CUDA build). DeepSpeed's CPU shared-memory collective is JIT-compiled at first
# use (~35 s): build it here once so that trials and tests do not pay for it, with the venv's ninja,
# which the ranks use too (trial/launcher.py trial_env; the system's ninja would not read its build log).
$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	PATH=$(abspath $(VENV))/bin:$$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	touch $(STAMP)

# NVMe offload (offload_device=nvme) needs DeepSpeed's async_io op, built against libaio's headers:
# ~2 minutes on 2 cores, which the demo (no NVMe) must not pay. The tests build it here, before pytest,
# so no trial's time limit pays for it; libaio's headers come from apt where this runs as root (CI).
# Elsewhere a run that asks for NVMe builds it once before its first trial (doctor.prebuild_ops),
# `zero_bench doctor` names the command, and nvme runs are refused (their tests skip) without libaio.
$(AIO): $(STAMP)
	-test -e /usr/include/libaio.h || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get update -qq || true; } && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null; }
	-test -e /usr/include/libaio.h && PATH=$(abspath $(VENV))/bin:$$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('AsyncIOBuilder').load()" >/dev/null
	touch $(AIO)

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

# The unit tests launch nothing (no machine lock, no pool): two xdist workers, one per core. The
# integration tests launch 2- and 4-rank trials that take the machine lock one at a time: serial.
# Both always run; make fails when either did.
test: $(STAMP) $(AIO)
	$(PY) -m pytest -q -n 2 tests/unit; unit=$$?; $(PY) -m pytest -q tests/integration; integration=$$?; \
	test $$unit = 0 && test $$integration = 0

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit

doctor: $(STAMP)
	$(PY) -m zero_bench doctor

report: $(STAMP)
	$(PY) -m zero_bench report

clean:
	rm -rf runs results reports/*.xlsx reports/*.csv reports/*.md reports/*.png
