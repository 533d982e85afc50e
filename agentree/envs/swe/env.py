"""SWE tasks in Docker sandboxes that fork mid-episode, graded the SWE-bench way.

The agent works mini-swe-agent style: every response holds exactly one ```bash block; the
command runs as an independent `bash -lc` in the repository (nothing but the filesystem carries
over, which is what makes a filesystem snapshot a faithful fork). The command
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` submits: the patch is `git diff` of the
repository, graded in a fresh container with the instance's tests (reward 1.0 iff resolved).
The episode is truncated, and what is there graded, at `step_limit` actions.

`snapshot()` commits the container (see `agentree.envs.swe.store` for the image lifetime rules)
and returns an `SWEState`; `restore(state)` works on any SWEEnv with the same config, including
one that was never reset. Calls on one env are serialised by a lock; different envs can be
stepped from different threads.
"""

from __future__ import annotations

import base64
import random
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from agentree.envs.base import (
    ActionFormat,
    Env,
    EnvConfig,
    Task,
    read_records,
    records_to_tasks,
)
from agentree.envs.swe import local_suite
from agentree.envs.swe.grading import grade
from agentree.envs.swe.images import ensure_image, ensure_images
from agentree.envs.swe.instances import docker_id, from_record
from agentree.envs.swe.runtime import install_signal_handlers
from agentree.envs.swe.sandbox import Sandbox, SandboxConfig, SandboxError
from agentree.envs.swe.tools import SWE_TOOLS, call_key, patch_calls, sandbox_command
from agentree.prompts import render
from agentree.tools import ToolCall, ToolSpec, as_tool_action, call_format

SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT_ACTION = f"THOUGHT: I am done; submit the changes.\n\n```bash\necho {SENTINEL}\n```"
VERIFIED_DATASET = "princeton-nlp/SWE-bench_Verified"
DEFAULT_ENV = (
    ("PAGER", "cat"),
    ("MANPAGER", "cat"),
    ("GIT_PAGER", "cat"),
    ("LESS", "-R"),
    ("PIP_PROGRESS_BAR", "off"),
    ("TQDM_DISABLE", "1"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
)
FORMAT_ERROR_KEY = "<format-error>"
PATCH_TIMEOUT_S = 120.0
"""Seconds `git diff` of the submission may take."""

_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.S)
_SUBMIT = re.compile(rf"^\s*echo\s+['\"]?{SENTINEL}['\"]?\s*$")
_APPLY = re.compile(r"\bgit\s+apply\b|(^|[;&|]\s*)patch\s")
"""A command line that applies a patch (`git apply`, `patch -p1 ...`)."""


class SWEConfig(EnvConfig):
    """Settings of SWEEnv (all optional)."""

    step_limit: int = Field(50, ge=1)
    """Agent actions per episode (PATR: 50 turns on SWE); the episode is truncated and graded."""
    command_timeout: float = Field(60.0, gt=0)
    """Seconds one action may run before it is killed with everything it started."""
    max_output: int = Field(10_000, ge=256)
    """Bytes of command output shown; the middle of longer output is elided."""
    grade: bool = True
    """Grade submissions (and truncated episodes); off gives reward 0 and no grading info."""
    grade_timeout: float = Field(1800.0, gt=0)
    """Seconds the instance's tests may run when grading."""
    network: bool = False
    """Give sandboxes network access (off by default)."""
    mem_limit: str = "4g"
    """Memory limit of each sandbox container (Docker syntax: 512m, 4g)."""
    cpus: float = Field(1.0, gt=0)
    """CPU quota of each sandbox container, in cores."""
    pids_limit: int = Field(1024, ge=16)
    """Most processes a sandbox container may hold."""
    prewarm: int = Field(1, ge=0)
    """Spare started containers kept per image in use (fast forks and resets); 0 disables."""
    image: str | None = None
    """Image name template overriding the instances' images, e.g.
    'registry/sweb.eval.x86_64.{docker_id}:latest' ({instance_id} and {docker_id} are filled)."""
    build_local: bool = True
    """Build missing images of the bundled local suite on demand."""
    action_format: ActionFormat = "text"
    """text: one ```bash block per response (mini-swe-agent); tools: calls of execute_bash,
    file_editor, search and submit (R2E-Gym / SWE-agent, `agentree.envs.swe.tools`)."""


@dataclass(frozen=True)
class SWEState:
    """What `SWEEnv.snapshot` returns: the committed filesystem plus the episode counters."""

    snapshot: Any  # agentree.envs.swe.sandbox.Snapshot
    instance: Any  # agentree.envs.swe.instances.SWEInstance
    steps: int
    done: bool
    config: tuple
    apply_error: str = ""


class SWEEnv(Env):
    """Fix a repository issue with bash commands in a Docker sandbox (see module docstring)."""

    Config: ClassVar[type[EnvConfig]] = SWEConfig
    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, **kwargs: Any) -> None:
        self.config = SWEConfig(**kwargs)
        self._tools = self.config.action_format == "tools"
        self.system_prompt = render("swe/system_tools.txt" if self._tools else "swe/system.txt")
        install_signal_handlers()  # envs are usually built in the main thread, Docker calls not
        self._lock = threading.RLock()
        self._sandbox: Any = None
        self._instance: Any = None
        self._steps = 0
        self._done = False
        self._apply_error = ""
        """Output of the episode's last patch-applying command that failed (for diagnosis)."""

    # -- episode ----------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        inst = self.instance_from_options(options)
        with self._lock:
            self._close_sandbox()
            ensure_image(inst, build=self.config.build_local, progress=_notify)
            sb = Sandbox(inst.image, self._sandbox_config(inst))
            try:
                if inst.prepare_script:
                    r = sb.exec(inst.prepare_script, timeout=300)
                    if r.returncode != 0:
                        raise SandboxError(
                            f"preparing {inst.instance_id} failed: {r.output[-400:]}"
                        )
                if inst.setup_script:
                    r = sb.exec(inst.setup_script, timeout=300)
                    if r.returncode != 0:
                        raise SandboxError(f"setup of {inst.instance_id} failed: {r.output[-400:]}")
            except BaseException:
                sb.close()
                raise
            self._sandbox, self._instance, self._steps, self._done = sb, inst, 0, False
            self._apply_error = ""
        return self._instance_prompt(inst, sb.config.workdir), {
            "instance_id": inst.instance_id,
            "image": inst.image,
        }

    def _instance_prompt(self, inst: Any, workdir: str) -> str:
        if self._tools:
            return render(
                "swe/instance_tools.txt",
                problem_statement=inst.problem_statement.strip(),
                workdir=workdir,
                step_limit=self.config.step_limit,
            )
        return render(
            "swe/instance.txt",
            problem_statement=inst.problem_statement.strip(),
            workdir=workdir,
            step_limit=self.config.step_limit,
            sentinel=SENTINEL,
        )

    def tools(self) -> list[ToolSpec]:
        return list(SWE_TOOLS) if self._tools else []

    def turn_limit(self) -> int:
        return self.config.step_limit

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with self._lock:
            if self._sandbox is None:
                raise RuntimeError("call reset() or restore() before step()")
            if self._done:
                raise RuntimeError("the episode has ended; call reset() or restore() first")
            self._steps += 1
            info: dict[str, Any] = {"step": self._steps}
            if self._tools:
                return self._tool_step(action, info)
            commands = parse_commands(action)
            if len(commands) != 1:
                info.update(action_key=FORMAT_ERROR_KEY, format_error=True)
                obs = render("swe/format_error.txt", count=len(commands), sentinel=SENTINEL)
                return self._after_action(obs, info)
            command = commands[0]
            info.update(action_key=action_key(command), format_error=False)
            if is_submit(command):
                return self._finish(info, truncated=False)
            obs = self._bash(command, info)
            if obs is None:
                return self._finish(info, truncated=False)
            return self._after_action(obs, info)

    def _bash(self, command: str, info: dict[str, Any]) -> str | None:
        """Run one command; its observation, or None when its output submits."""
        res = self._sandbox.exec(
            command, self.config.command_timeout, max_output=self.config.max_output
        )
        info.update(returncode=res.returncode, timed_out=res.timed_out, elapsed=res.elapsed)
        applying = [ln.strip() for ln in command.splitlines() if _APPLY.search(ln)]
        if applying and res.returncode != 0:
            self._apply_error = f"{applying[-1]} (exit {res.returncode}): {res.output[-600:]}"
        if res.output.lstrip().split("\n", 1)[0].strip() == SENTINEL:
            return None
        if res.timed_out:
            return render(
                "swe/timeout.txt", timeout=f"{self.config.command_timeout:g}", output=res.output
            )
        return render("swe/observation.txt", returncode=res.returncode, output=res.output)

    def _tool_step(self, action: str, info: dict[str, Any]) -> tuple:
        """One turn of tool calls, run in order; `submit` ends the episode at once."""
        parsed = as_tool_action(action, SWE_TOOLS)
        if parsed.error:
            info.update(action_key=FORMAT_ERROR_KEY, format_error=True)
            return self._after_action(render("swe/tool_error.txt", error=parsed.error), info)
        info.update(action_key="\n".join(call_key(c) for c in parsed.calls), format_error=False)
        results = []
        for call in parsed.calls:
            if call.name == "submit":
                return self._finish(info, truncated=False)
            if call.name == "execute_bash":
                obs = self._bash(str(call.arguments["command"]), info)
                if obs is None:
                    return self._finish(info, truncated=False)
                results.append(obs)
                continue
            res = self._sandbox.exec(
                sandbox_command(call),
                self.config.command_timeout,
                max_output=self.config.max_output,
            )
            info.update(returncode=res.returncode, timed_out=res.timed_out, elapsed=res.elapsed)
            if res.timed_out:
                timeout = f"{self.config.command_timeout:g}"
                results.append(render("swe/timeout.txt", timeout=timeout, output=res.output))
            else:
                results.append(res.output)
        info["tool_results"] = results
        return self._after_action("\n\n".join(results), info)

    def _after_action(self, obs: str, info: dict[str, Any]) -> tuple:
        if self._steps >= self.config.step_limit:
            return self._finish(info, truncated=True, obs=obs)
        return obs, 0.0, False, False, info

    def _finish(self, info: dict[str, Any], *, truncated: bool, obs: str | None = None) -> tuple:
        """End the episode: take the patch, grade it, report it."""
        self._done = True
        patch, problem = self.current_patch()
        reward, grading = 0.0, None
        if self.config.grade:
            grading = self._grade(patch, problem)
            reward = 1.0 if grading["resolved"] else 0.0
            if self._apply_error and not patch.strip():
                grading["apply_error"] = self._apply_error  # why the submission is empty
        info.update(
            end="step_limit" if truncated else "submitted",
            success=reward >= 1.0,
            prediction={"instance_id": self._instance.instance_id, "model_patch": patch},
            grading=grading,
        )
        if obs is None:
            summary = f"a patch touching {len(re.findall(r'^diff --git ', patch, re.M))} file(s)"
            if not patch.strip():
                summary = "an empty patch (no changes)"
            obs = render("swe/submitted.txt", summary=summary)
        return obs, reward, not truncated, truncated, info

    def current_patch(self) -> tuple[str, str]:
        """`git diff` of the repository including new files, and a problem if it is unusable
        (git failed: the agent's doing, graded as unresolved).

        Staging happens in a throwaway index, so the repository's own index is untouched. A
        patch that could not be read (output cut in transit, time out) raises `SandboxError`,
        so the episode ends as an env error instead of being graded as an empty patch.
        """
        with self._lock:
            excludes = " ".join(f"':(exclude){p}'" for p in self._instance.hidden_paths)
            res = self._sandbox.exec(
                'idx=$(mktemp -u) && { cp "$(git rev-parse --git-path index)" "$idx" || true; } '
                '&& GIT_INDEX_FILE="$idx" git add -A && GIT_INDEX_FILE="$idx" git diff --cached '
                f'--no-color --no-ext-diff -- . {excludes}; rc=$?; rm -f "$idx"; exit $rc',
                timeout=PATCH_TIMEOUT_S,
                max_output=64 * 1024 * 1024,
                read_only=True,  # a second run reads the same diff
            )
        if res.timed_out:
            raise SandboxError(
                f"taking the patch (git add -A; git diff) timed out after {PATCH_TIMEOUT_S:g}s"
            )
        if res.returncode != 0:
            return "", f"git diff failed: {res.output[-300:]}"
        if res.elided:
            return "", "the patch is larger than 64 MiB"
        return res.output, ""

    def _grade(self, patch: str, problem: str) -> dict[str, Any]:
        if problem:
            return {
                "resolved": False,
                "status": "RESOLVED_NO",
                "patch_applied": False,
                "reason": problem,
                "tests": {},
                "report": {},
            }
        res = grade(
            self._instance,
            patch,
            config=self._sandbox_config(self._instance),
            timeout=self.config.grade_timeout,
        )
        return res.to_info()

    # -- forking ----------------------------------------------------------------------------
    def snapshot(self) -> SWEState:
        with self._lock:
            if self._sandbox is None:
                raise RuntimeError("call reset() before snapshot()")
            return SWEState(
                self._sandbox.snapshot(),
                self._instance,
                self._steps,
                self._done,
                self._key(),
                self._apply_error,
            )

    def restore(self, state: Any) -> None:
        if not isinstance(state, SWEState):
            raise TypeError(f"SWEEnv.restore expects an SWEState, got {type(state).__name__}")
        if state.config != self._key():
            raise ValueError(
                "this snapshot was taken by an SWEEnv with a different config; restore it into "
                "an env built with the same settings"
            )
        with self._lock:
            cfg = self._sandbox_config(state.instance)
            if self._sandbox is not None and self._sandbox.config == cfg:
                self._sandbox.restore(state.snapshot)
            else:
                self._close_sandbox()
                self._sandbox = Sandbox(state.snapshot, cfg)
            self._instance, self._steps, self._done = state.instance, state.steps, state.done
            self._apply_error = state.apply_error

    def close(self) -> None:
        with self._lock:
            self._close_sandbox()

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            sb, self._sandbox = self._sandbox, None
            sb.close()

    def _key(self) -> tuple:
        return tuple(sorted(self.config.model_dump().items()))

    def _sandbox_config(self, inst: Any) -> Any:
        c = self.config
        env = dict(DEFAULT_ENV)
        env.update(dict(inst.env))
        return SandboxConfig(
            network=c.network,
            mem_limit=c.mem_limit,
            cpus=c.cpus,
            pids_limit=c.pids_limit,
            env=tuple(sorted(env.items())),
            prewarm=c.prewarm,
        )

    # -- tasks ------------------------------------------------------------------------------
    def instance_from_options(self, options: dict[str, Any] | None) -> Any:
        """The SWEInstance named by reset options ({"instance": record} or {"instance_id": id})."""
        return _instance_from_options(options, self.config.image)

    @classmethod
    def task_from_record(cls, record: dict[str, Any]) -> Task:
        """A Task from a SWE-bench / R2E-Gym record (or an agentree {"id", "options"} record)."""
        if isinstance(record, dict) and "id" in record and set(record) <= {"id", "seed", "options"}:
            return super().task_from_record(record)
        inst = from_record(record)
        return Task(inst.instance_id, None, {"instance": inst.to_record()})

    @classmethod
    def load_tasks(
        cls, spec: int | str | Path | None = None, *, seed: int = 0, split: str = "train"
    ) -> list[Task]:
        """A count, a JSON/JSONL file of instances, a SWE-bench task repo, `local` or `verified`."""
        if spec is None:  # the default source: the whole bundled suite
            return cls.named_tasks("local")
        if isinstance(spec, str | Path) and Path(spec).is_dir():
            return records_to_tasks(cls, _task_repo_records(Path(spec)), spec)
        if isinstance(spec, str | Path) and Path(spec).suffix in {".json", ".jsonl"}:
            return records_to_tasks(cls, read_records(Path(spec)), spec)
        return super().load_tasks(spec, seed=seed, split=split)

    @classmethod
    def generate_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """The first `n` tasks of the bundled local suite in a seeded order."""
        tasks = cls.named_tasks("local")
        if n > len(tasks):
            raise ValueError(
                f"the bundled local suite has {len(tasks)} tasks; ask for at most {len(tasks)}, "
                "or pass --tasks FILE (JSON/JSONL of SWE-bench instances) or --tasks verified"
            )
        random.Random(seed).shuffle(tasks)
        return tasks[:n]

    @classmethod
    def named_tasks(cls, name: str, *, seed: int = 0, split: str = "train") -> list[Task]:
        if name == "local":
            return [cls.task_from_record(r) for r in local_suite.records()]
        if name == "verified":
            return [cls.task_from_record(r) for r in load_verified()]
        return super().named_tasks(name, seed=seed, split=split)

    @classmethod
    def prepare_tasks(
        cls, tasks: Iterable[Task], *, progress: Callable[[str], None] | None = None, **config: Any
    ) -> None:
        """Make sure every task's image exists (builds missing local-suite images); no-op if so."""
        cfg = SWEConfig(**config)
        instances = [_instance_from_options(t.options, cfg.image) for t in tasks]
        ensure_images(instances, build=cfg.build_local, progress=progress or (lambda _: None))

    @classmethod
    def scripted_policy(
        cls, name: str, tools: Sequence[dict[str, Any]] = ()
    ) -> Callable[[Task, list[tuple[str, str]]], str] | None:
        """`gold` applies the reference patch then submits; `empty` submits at once. With
        `tools` (tool mode) both act through the tools: the gold patch as file_editor edits."""
        if tools:
            return {"gold": gold_tool_policy, "empty": empty_tool_policy}.get(name)
        return {"gold": gold_policy, "empty": empty_policy}.get(name)

    def corpus(self, tasks: Sequence[Task]) -> list[str]:
        """Prompts, actions and observation formats, rendered without starting a sandbox."""
        texts = []
        for task in tasks:
            inst = _instance_from_options(task.options, self.config.image)
            texts += [
                self.system_prompt or "",
                render(
                    "swe/instance.txt",
                    problem_statement=inst.problem_statement.strip(),
                    workdir="/testbed",
                    step_limit=self.config.step_limit,
                    sentinel=SENTINEL,
                ),
            ]
            texts += self.example_actions()
            texts.append(render("swe/observation.txt", returncode=0, output=inst.patch))
            texts.append(render("swe/format_error.txt", count=0, sentinel=SENTINEL))
        return texts

    def example_actions(self) -> list[str]:
        return [
            "THOUGHT: look around the repository.\n\n```bash\nls -a && git status --short\n```",
            "```bash\nprintf 'print(\"hello\")\\n' > agentree_check.py && python3 agentree_check.py"
            "\n```",
            "```bash\necho 'x = 1' >> agentree_check.py && wc -l agentree_check.py\n```",
            "```bash\ncat agentree_check.py && git status --short\n```",
        ]


def _notify(msg: str) -> None:
    """Progress of on-demand image builds and pulls (they can take a minute)."""
    print(f"agentree: {msg}", file=sys.stderr, flush=True)


# -- actions ---------------------------------------------------------------------------------
def parse_commands(action: str) -> list[str]:
    """The bash code blocks of a response."""
    return [m.strip("\n") for m in _BLOCK.findall(action)]


def action_key(command: str) -> str:
    """A canonical form of a command for repeated-action detection (PATR's theta): runs of
    blanks collapsed, blank lines dropped, line structure kept (a newline separates commands)."""
    return "\n".join(" ".join(ln.split()) for ln in command.splitlines() if ln.strip())


def is_submit(command: str) -> bool:
    first = next((ln for ln in command.splitlines() if ln.strip()), "")
    return bool(_SUBMIT.match(first.split("&&")[0]))


def apply_patch_action(patch: str) -> str:
    """An action that applies `patch` with git (base64, so any patch text survives parsing)."""
    encoded = base64.encodebytes(patch.encode()).decode()
    return (
        "THOUGHT: apply the fix.\n\n```bash\n"
        f"base64 -d > /tmp/agentree_fix.patch <<'AGENTREE_EOF'\n{encoded}AGENTREE_EOF\n"
        "git apply /tmp/agentree_fix.patch && rm /tmp/agentree_fix.patch && git status --short\n"
        "```"
    )


def gold_policy(task: Task, history: Sequence[tuple[str, str]]) -> str:
    """Apply the instance's gold patch through the bash interface, then submit."""
    if not history:
        inst = _instance_from_options(task.options, None)
        if inst.patch.strip():
            return apply_patch_action(inst.patch)
    return SUBMIT_ACTION


def empty_policy(task: Task, history: Sequence[tuple[str, str]]) -> str:
    """Submit without changing anything."""
    return SUBMIT_ACTION


def gold_tool_policy(task: Task, history: Sequence[tuple[str, str]]) -> str:
    """The gold patch through the tools, one call a turn (`patch_calls`), then `submit`."""
    inst = _instance_from_options(task.options, None)
    calls = [*patch_calls(inst.patch), ToolCall("submit")]
    return call_format("hermes").format([calls[min(len(history), len(calls) - 1)]])


def empty_tool_policy(task: Task, history: Sequence[tuple[str, str]]) -> str:
    """Call `submit` without changing anything."""
    return call_format("hermes").format([ToolCall("submit")])


# -- task sources ----------------------------------------------------------------------------
def _instance_from_options(options: dict[str, Any] | None, image_template: str | None) -> Any:
    options = options or {}
    if "instance" in options:
        inst = from_record(options["instance"])
    elif "instance_id" in options:
        slug = local_suite.slug_of(options["instance_id"])
        if slug is None:
            raise ValueError(f"{options['instance_id']!r} is not in the bundled local suite")
        inst = from_record(local_suite.record(slug))
    else:
        raise ValueError(
            'SWEEnv.reset needs options={"instance": <SWE-bench or R2E-Gym record>} (tasks from '
            'SWEEnv.load_tasks carry it) or {"instance_id": <local-suite id>}'
        )
    if image_template:
        try:
            image = image_template.format(
                instance_id=inst.instance_id, docker_id=docker_id(inst.instance_id)
            )
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"bad image template {image_template!r} ({e}); use {{instance_id}} or {{docker_id}}"
            ) from None
        inst = inst.with_image(image)
    return inst


def _task_repo_records(path: Path) -> list[dict[str, Any]]:
    """Instances of a swebench 5.x task repo (tasks/<instance_id>/task.yaml, ...)."""
    # deferred: swebench is the optional [swe] extra
    from swebench.task.repo import load_task, task_dirs

    try:
        return [load_task(d) for d in task_dirs(path)]
    except FileNotFoundError as e:
        raise ValueError(f"{path} is a folder but not a SWE-bench task repo: {e}") from None


def load_verified(split: str = "test") -> list[dict[str, Any]]:
    """SWE-bench Verified from the Hugging Face hub (needs network or a warm cache)."""
    try:
        # deferred: datasets is the optional [swe] extra
        from datasets import load_dataset

        return [dict(r) for r in load_dataset(VERIFIED_DATASET, split=split)]
    except Exception as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise RuntimeError(
            f"could not load {VERIFIED_DATASET} ({reason}); without network access, pass a "
            "local JSON/JSONL file of SWE-bench instances with --tasks FILE instead"
        ) from None
