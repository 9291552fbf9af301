# remat: `make train` and `make test` set up everything on a fresh Debian 12 machine.
SHELL := /bin/bash
VENV  := .venv
BUILD := build
DEBS  := clang-19 clang-tools-19 clang-format-19 universal-ctags ninja-build libboost-test-dev librange-v3-dev libcli11-dev \
         nlohmann-json3-dev libfmt-dev zlib1g-dev dataset-fashion-mnist fortunes python3-venv python3-dev \
         pocl-opencl-icd ocl-icd-libopencl1 libclang-rt-19-dev openmpi-bin libopenmpi-dev
PY_PKGS := halide==21.0.0 cmake>=3.28 mkl-static==2026.2.0 mkl-include==2026.2.0 nvidia-nccl-cu13==2.30.7
TRAIN_ARGS ?=
# make bench-cpu and make test: PyTorch and what bench/cpu.py, scripts/plot.py, the memory timeline
# tests and the Transformers tests (tests/transformers_models.py) need; flags for bench/cpu.py (BENCH_ARGS="--steps 8")
BENCH_PY_PKGS := torch==2.15.0 safetensors==0.8.0 matplotlib==3.11.2 transformers==5.25.0
BENCH_ARGS ?=
# make train-gpt-bpe only: the BPE tokenizer of scripts/bpe.py, and where its token files go
TOKENIZE_PY_PKGS := tokenizers==0.23.3
BPE_DATA := $(BUILD)/data/fortunes-bpe

.PHONY: all deps build install train train-gpt train-mlp train-llama train-gpt-bpe train-gpt2 train-smollm2 test-transformers-full test-witness-full test test-sanitize fuzz bench bench-cpu bench-hf bench-hf-context bench-py-pkgs device-bundle clean

all: build

# Debian packages: installed when missing (as root), otherwise the one command to run is printed.
deps:
	@missing=$$(for p in $(DEBS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:" $$missing; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else \
	    echo "missing Debian packages; run: sudo apt-get install -y" $$missing; exit 1; \
	  fi; \
	fi
	@$(MAKE) --no-print-directory $(VENV)/.installed

# Project-local Python environment with Halide 21 (libHalide, headers, CMake package), CMake,
# MKL (static libraries and headers: the CPU GEMMs) and NCCL (nccl.h and libnccl.so.2: data-parallel
# ranks on GPUs; the version PyTorch pins).
$(VENV)/.installed: Makefile
	/usr/bin/python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(foreach p,$(PY_PKGS),'$(p)')
	touch $@

$(BUILD)/build.ninja: CMakeLists.txt | deps
	$(VENV)/bin/cmake -S . -B $(BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++-19 \
	  -DCMAKE_BUILD_TYPE=Release \
	  -DHalide_DIR="$$($(VENV)/bin/python -c "import halide, os; print(os.path.dirname(halide.__file__))")/lib64/cmake/Halide"

build: deps $(BUILD)/build.ninja
	$(VENV)/bin/cmake --build $(BUILD)

# The main example: the character-level GPT on the fortune cookie corpus.
train: train-gpt

train-gpt: build
	$(BUILD)/bin/train-gpt $(TRAIN_ARGS)

train-mlp: build
	$(BUILD)/bin/train-mlp $(TRAIN_ARGS)

train-llama: build
	$(BUILD)/bin/train-llama $(TRAIN_ARGS)

# A GPT over byte-level BPE tokens: scripts/bpe.py trains the tokenizer on the fortunes and
# writes the token files (again only when the script or this file changed), then the trainer
# reads them; its sample (token ids) goes through the tokenizer's decoder.
$(BPE_DATA)/tokenizer.json: scripts/bpe.py Makefile | deps
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(foreach p,$(TOKENIZE_PY_PKGS),'$(p)')
	$(VENV)/bin/python scripts/bpe.py train --corpus /usr/share/games/fortunes --vocab 4096 --out $(BPE_DATA)

train-gpt-bpe: build $(BPE_DATA)/tokenizer.json
	set -o pipefail; $(BUILD)/bin/train-gpt-bpe --data-dir $(BPE_DATA) $(TRAIN_ARGS) | \
	  $(VENV)/bin/python scripts/bpe.py decode --tokenizer $(BPE_DATA)/tokenizer.json

# GPT-2 124M and SmolLM2-135M (examples/gpt2, examples/smollm2: Transformers' architectures at their
# published sizes, context 1024) on the same BPE token files; a short run (about ten minutes on two
# cores) unless TRAIN_ARGS says otherwise.
train-gpt2: build $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target train-gpt2
	$(BUILD)/bin/train-gpt2 --data-dir $(BPE_DATA) $(TRAIN_ARGS)

train-smollm2: build $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target train-smollm2
	$(BUILD)/bin/train-smollm2 --data-dir $(BPE_DATA) $(TRAIN_ARGS)

# The full-size comparison with Transformers (slow, outside the default ctest): GPT-2 124M and
# SmolLM2-135M from folders Transformers made, first loss, gradients, one AdamW step, round trip.
test-transformers-full: build bench-py-pkgs
	$(VENV)/bin/cmake --build $(BUILD) --target train-gpt2 train-smollm2
	$(VENV)/bin/python tests/transformers_models.py --full --gpt2 $(BUILD)/bin/train-gpt2 \
	  --llama $(BUILD)/bin/train-smollm2 --work $(BUILD)/transformers_full

# The outside witness at full size (slow, outside the default ctest): GPT-2 124M and SmolLM2-135M,
# every policy and a budget, fp32 and bf16: peak RSS from outside against the plan.
test-witness-full: build $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target train-gpt2 train-smollm2
	$(VENV)/bin/python tests/outside_witness.py $(BUILD)/bin/train-gpt2 $(BUILD)/bin/train-smollm2

# PyTorch, safetensors, matplotlib and Transformers in $(VENV), when missing.
bench-py-pkgs: | deps
	@$(VENV)/bin/python -c 'import torch, safetensors, matplotlib, transformers' 2>/dev/null || \
	  $(VENV)/bin/pip install --quiet --disable-pip-version-check $(foreach p,$(BENCH_PY_PKGS),'$(p)')

# ctest's own results also go to $(BUILD)/ctest-results.xml (JUnit), which .ci/run counts. The
# memory timeline tests open the trainer's snapshots with PyTorch's own tools (bench-py-pkgs).
# Two tests at a time (no test is timed; the slowest, test_trainer and consumer, then overlap).
test: build bench-py-pkgs
	$(VENV)/bin/ctest --test-dir $(BUILD) -j2 --output-on-failure --output-junit $(abspath $(BUILD))/ctest-results.xml

# make test-sanitize: the suite again, every object of its own build folder compiled with
# AddressSanitizer + UndefinedBehaviorSanitizer (C++ modules must all agree on the flags, hence a
# whole build; the Halide kernels and the model compilers' libHalide stay uninstrumented). About
# 30 min from scratch on 2 cores, not part of `make test`. Leaks are not checked while building
# (the model compilers run libHalide, LLVM inside) but are while testing (cmake/lsan.supp: only
# other libraries' own). The consumer test builds an unsanitized project against it: left out.
SANITIZE_BUILD := build-sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -gline-tables-only
SANITIZE_ENV := ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1 \
                LSAN_OPTIONS=suppressions=$(abspath cmake/lsan.supp):print_suppressions=0 \
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
HALIDE_DIR = $$($(VENV)/bin/python -c "import halide, os; print(os.path.dirname(halide.__file__))")/lib64/cmake/Halide

$(SANITIZE_BUILD)/build.ninja: CMakeLists.txt | deps
	$(VENV)/bin/cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++-19 -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_CXX_FLAGS="$(SANITIZE_FLAGS)" -DHalide_DIR="$(HALIDE_DIR)"

test-sanitize: deps bench-py-pkgs $(SANITIZE_BUILD)/build.ninja
	ASAN_OPTIONS=detect_leaks=0 $(VENV)/bin/cmake --build $(SANITIZE_BUILD)
	$(SANITIZE_ENV) $(VENV)/bin/ctest --test-dir $(SANITIZE_BUILD) -j2 --output-on-failure -E '^consumer$$'

# make fuzz: each libFuzzer target of fuzz/ (a reader of user input, or the flags and --config)
# for FUZZ_SECONDS, in a build folder whose objects all carry -fsanitize=fuzzer-no-link and the
# sanitizers (no kernels needed: the targets link Halide's bare runtime). A crash is kept in
# fuzz/regressions/<target>/, which `make test` replays (ctest fuzz_replay_<target>).
FUZZ_BUILD := build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= idx text tokens data_state flags safetensors

$(FUZZ_BUILD)/build.ninja: CMakeLists.txt | deps
	$(VENV)/bin/cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++-19 -DCMAKE_BUILD_TYPE=Release \
	  -DREMAT_FUZZ=ON -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link $(SANITIZE_FLAGS)" -DHalide_DIR="$(HALIDE_DIR)"

fuzz: deps $(FUZZ_BUILD)/build.ninja
	$(VENV)/bin/cmake --build $(FUZZ_BUILD) --target $(addprefix fuzz_,$(FUZZ_TARGETS))
	bash fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# remat as a CMake package for other projects (docs/using-remat.md): make install PREFIX=$HOME/opt/remat
PREFIX ?= /usr/local
install: build
	$(VENV)/bin/cmake --install $(BUILD) --prefix $(PREFIX)

# Each benchmark's output becomes a page of the manual, docs/results/<name>.md, with the command,
# the date and the CPU (scripts/bench-page.py): tables of figures in docs/ are generated, not pasted.
BENCH_PAGE = python3 scripts/bench-page.py
bench: build $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target bench-budget
	$(BENCH_PAGE) policies --title "Checkpoint policies: step time and memory" -- $(BUILD)/bin/bench-policies 20
	$(BENCH_PAGE) budget --title "Budget plans against uniform policies" -- $(BUILD)/bin/bench-budget 20
	$(BENCH_PAGE) gemm --title "remat's CPU GEMMs at the models' shapes" -- $(BUILD)/bin/bench-gemm 30
	$(BENCH_PAGE) ranks --title "Data-parallel ranks against one process" -- \
	  $(VENV)/bin/python bench/ranks.py --models gpt,mlp,gpt_bpe --policies none,full --rounds 2 --steps 20
	$(BUILD)/bin/bench-gpu

# remat against PyTorch eager and torch.compile on this CPU, side by side (bench/cpu.py; writes
# bench/results/cpu.json and cpu.png). PyTorch goes into $(VENV) first (bench-py-pkgs).
bench-cpu: build bench-py-pkgs $(BPE_DATA)/tokenizer.json
	$(BENCH_PAGE) gemm-torch --title "remat's GEMMs against torch.matmul" -- $(VENV)/bin/python bench/gemm.py
	$(BENCH_PAGE) cpu --title "remat against PyTorch eager and torch.compile" -- $(VENV)/bin/python bench/cpu.py $(BENCH_ARGS)

# GPT-2 124M and SmolLM2-135M against Transformers (bench/hf.py: every policy and budget plans
# against checkpointing off and on, fp32 and bf16, a fresh process a row; its table also goes into
# README.md) and the attention alone against PyTorch's SDPA (bench/attention.py). Flags for
# bench/hf.py: HF_ARGS="--models gpt2 --precisions bf16" (the whole run takes about half an hour on two cores).
HF_ARGS ?=
bench-hf: build bench-py-pkgs $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target train-gpt2 train-smollm2 bench-attention
	$(BENCH_PAGE) attention --title "Causal attention against PyTorch's SDPA" -- $(VENV)/bin/python bench/attention.py
	$(BENCH_PAGE) hf --title "GPT-2 124M and SmolLM2-135M against Transformers" --markdown --readme -- \
	  $(VENV)/bin/python bench/hf.py $(HF_ARGS)

# The context sweep (bench/hf.py --sweep): the longest context Transformers with checkpointing on
# and remat's full plan each train under RSS caps of 4 and 8 GiB, both models and precisions, with
# remat's trainers generated at contexts 2048-8192 (bench/CMakeLists.txt). About an hour on two cores.
SWEEP_CONTEXTS := 2048 4096 8192
bench-hf-context: build bench-py-pkgs $(BPE_DATA)/tokenizer.json
	$(VENV)/bin/cmake --build $(BUILD) --target train-gpt2 train-smollm2 \
	  $(foreach t,$(SWEEP_CONTEXTS),train-gpt2-t$(t) train-smollm2-t$(t))
	$(BENCH_PAGE) hf-context --title "The longest context under an RSS cap, against Transformers" --markdown --readme -- \
	  $(VENV)/bin/python bench/hf.py --sweep $(HF_ARGS)

# What scripts/device-check.sh needs on a GPU machine without registries, in .device/.
device-bundle: build $(BPE_DATA)/tokenizer.json
	bash scripts/device-bundle.sh

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD) $(FUZZ_BUILD)
