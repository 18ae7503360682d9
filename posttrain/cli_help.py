"""The trainers' flags, and their help: `posttrain TRAINER --help` (each command of posttrain/registry.py).

Every field of the script arguments, LoRA and the trainer's config is a flag (`add_fields`), as are accelerate's
launch settings (`add_launch_flags`); cli.py parses with all of them. The help shows them a page at a time:

    posttrain grpo --help          the fields set most often, then the groups and how to see them (one screen)
    posttrain grpo --help GROUP    one group's fields (the groups of docs/config.md: training, model, logging, ...)
    posttrain grpo --help FIELD    one field
    posttrain grpo --help-all      every field, group by group

No torch here: help answers at once.
"""

import argparse
import dataclasses
import shutil
import textwrap

from posttrain.configs import ConfigError, LoraArguments, field_help, field_types, suggest
from posttrain.configs.base import base_type
from posttrain.registry import COMMANDS, TRAINERS

# the fields a user sets most often, in the order the first page shows them
COMMON = {name: entry.common for name, entry in COMMANDS.items()}
# each field class's group name (`--help GROUP`), as docs/config.md groups the fields
GROUP_NAMES = {
    "ScriptArguments": "script", "BaseScriptArguments": "script", "LoraArguments": "lora",
    "TrainingLoopConfig": "training", "ModelConfig": "model", "DeviceConfig": "devices", "LoggingConfig": "logging",
    "EvaluationConfig": "evaluation", "CheckpointConfig": "saving", "PromptDataConfig": "prompts",
    "SamplingConfig": "generation", "GRPOObjectiveConfig": "loss", "GenerationServerConfig": "vllm",
    "AsyncGenerationConfig": "async",
    "SFTDataConfig": "data", "SFTLossConfig": "loss", "DPODataConfig": "data", "DPOReferenceConfig": "reference",
    "DPOLossConfig": "loss", "RLOOObjectiveConfig": "rloo",
    "RewardDataConfig": "data", "RewardLossConfig": "loss", "KTODataConfig": "data", "KTOLossConfig": "loss",
    "DistillationObjectiveConfig": "distillation",
}
LAUNCH_GROUP = "launch"
USAGE = "posttrain {command} [--config FILE] [--FIELD VALUE ...] [launch flags]"


def field_classes(script_cls, config_cls) -> tuple:
    """The classes whose fields are a trainer command's flags, in the order the help shows them (a group whose fields
    are none of the command's flags, as RLOO's async group, is left out)."""
    hidden = set(config_cls.NOT_FLAGS)
    return tuple(cls for cls in (script_cls, LoraArguments, *config_cls.GROUPS, config_cls.COMPAT)
                 if set(field_types(cls)) - hidden)


def group_name(cls) -> str:
    """`--help GROUP`'s name of a field class: "trl" for the TRL fields, GROUP_NAMES', else the class's name without
    its trainer's title and "Config" (a new trainer's "ORPOLossConfig": "loss")."""
    name = cls.__name__
    if name.endswith("CompatConfig"):
        return "trl"
    if name in GROUP_NAMES:
        return GROUP_NAMES[name]
    title = next((e.title for e in sorted(TRAINERS, key=lambda e: -len(e.title)) if name.startswith(e.title)), "")
    return name[len(title):].removesuffix("Config").lower() or name.lower()


def _summary(cls) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _headline(cls) -> str:
    """A group's summary up to its first full stop or colon: one line of the first page."""
    text = _summary(cls).split(". ")[0].split(": ")[0]
    return text if text.endswith(".") else f"{text}."


METAVARS = {int: "N", float: "X", bool: "BOOL", dict: "JSON"}  # any other type: VALUE


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def add_fields(parser: argparse.ArgumentParser, cls, seen: set, only=None) -> None:
    """One flag per field of `cls` not already in `seen` (a field shared by two classes is one flag); with `only`,
    those fields alone (for a help page)."""
    group = parser.add_argument_group(f"{group_name(cls)} ({cls.__name__})", _fill(_summary(cls), 2)) \
        if only is None else parser
    types, helps = field_types(cls), field_help(cls)
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls)}
    for name, tp in types.items():
        if name in seen or (only is not None and name not in only):
            continue
        seen.add(name)
        is_list = "list" in str(tp).lower()
        is_bool = tp is bool or str(tp).endswith("bool]")
        kwargs = {"nargs": "+"} if is_list else {"nargs": "?", "const": "true"} if is_bool else {}
        metavar = "BOOL" if is_bool else "VALUE" if is_list else METAVARS.get(base_type(tp), "VALUE")
        group.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, metavar=metavar,
                           help=f"{helps.get(name, '')} (default: {defaults.get(name)!r})".replace("%", "%%"),
                           **kwargs)


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    from posttrain.launch import LAUNCH_FLAGS, SHIPPED

    group = parser.add_argument_group(f"{LAUNCH_GROUP} (accelerate)", _fill(
        "Launch settings: given any of them, posttrain relaunches itself with `accelerate launch` (also as YAML keys).",
        2))
    group.add_argument("--accelerate_config", metavar="NAME|PATH", default=argparse.SUPPRESS,
                       help=f"An accelerate config file, or one of the shipped ones: {', '.join(SHIPPED)}.")
    for name, takes_value in LAUNCH_FLAGS.items():
        group.add_argument(f"--{name}", default=argparse.SUPPRESS, help=f"accelerate launch's --{name}.",
                           **({"metavar": name.upper()} if takes_value else {"action": "store_true"}))


def add_run_options(parser) -> None:
    """--config, --quiet and --verbose: a trainer command's options that are not fields."""
    parser.add_argument("--config", metavar="FILE", help="YAML file of field: value pairs (any field).")
    parser.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="Nothing per step, only errors (log_level error, no progress bar).")
    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="posttrain's and transformers' info messages and their progress bars (log_level info).")


def help_topic(argv: list[str]) -> str | None:
    """What a trainer command's arguments ask help for: None (no help), "" (the first page), "all" or a group or
    field name (`--help NAME`, `--help=NAME`, `--help-all`)."""
    for i, token in enumerate(argv):
        if token == "--help-all":
            return "all"
        if token.startswith("--help="):
            return token.partition("=")[2]
        if token in ("-h", "--help"):
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if following.startswith("-") else following
    return None


def _width() -> int:
    """argparse's width for help (the terminal's, less 2), at most 100."""
    return min(100, shutil.get_terminal_size().columns - 2)


def _fill(text: str, indent: int = 0) -> str:
    """`text` wrapped to the help's width, for a page that prints its texts as they are (a group's description is
    indented by 2)."""
    return textwrap.fill(text, _width() - indent)


def _page(command: str, description: str = "", epilog: str = "") -> argparse.ArgumentParser:
    page = argparse.ArgumentParser(prog=f"posttrain {command}", usage=USAGE.format(command=command), add_help=False,
                                   description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    return page


def _owners(classes) -> dict:
    """field name -> the class whose group shows it (the first that declares it)."""
    owners = {}
    for cls in classes:
        for name in field_types(cls):
            owners.setdefault(name, cls)
    return owners


def trainer_help(command: str, script_cls, config_cls, line: str, topic: str) -> str:
    """The help page `topic` (help_topic's) of `posttrain <command>`; ConfigError for an unknown topic."""
    classes = field_classes(script_cls, config_cls)
    hidden = set(config_cls.NOT_FLAGS)
    owners = {name: cls for name, cls in _owners(classes).items() if name not in hidden}
    groups = {group_name(cls): cls for cls in classes}
    if topic == "":
        return _first_page(command, classes, owners, line)
    if topic == "all":
        page = _page(command, _fill(f"{line} Flags override the values in --config."))
        add_run_options(page.add_argument_group("options"))
        seen = set(hidden)
        for cls in classes:
            add_fields(page, cls, seen)
        add_launch_flags(page)
        return page.format_help()
    page = _page(command)
    if topic == LAUNCH_GROUP:
        add_launch_flags(page)
    elif topic in groups:  # under its title, as --help-all shows it
        add_fields(page, groups[topic], hidden | {name for name, owner in owners.items() if owner is not groups[topic]})
    elif topic in owners:
        add_fields(page, owners[topic], set(owners) - {topic})
    else:
        names = [*groups, LAUNCH_GROUP, "all", *owners]
        raise ConfigError(f"`posttrain {command} --help {topic}` names no group or field.{suggest(topic, names, '')} "
                          f"Groups: {', '.join([*groups, LAUNCH_GROUP])}; or a field's name, or --help-all.")
    return page.format_help()


def _first_page(command: str, classes, owners: dict, line: str) -> str:
    """The fields set most often, the groups, and the one line saying how to see the rest."""
    rows = [f"  {group_name(cls):<11} {_headline(cls)} ({sum(owner is cls for owner in owners.values())} fields)"
            for cls in classes]
    rows.append(f"  {LAUNCH_GROUP:<11} accelerate's launch settings (--accelerate_config, --num_processes, ...).")
    wrapped = [textwrap.fill(row, _width(), subsequent_indent=" " * 14) for row in rows]
    epilog = "\n".join(["field groups:", *wrapped, "",
                        f"The rest: --help GROUP, --help FIELD, or --help-all (all {len(owners)} fields)."])
    page = _page(command, _fill(f"{line} Flags override the values in --config; a boolean flag alone means true."),
                 epilog)
    options = page.add_argument_group("options")
    options.add_argument("-h", "--help", metavar="GROUP|FIELD", nargs="?",
                         help="This page; with a group's or a field's name, its flags.")
    options.add_argument("--help-all", action="store_true", help="Every field's flag, group by group.")
    add_run_options(options)
    common = page.add_argument_group("most used")
    seen: set = set()
    for name in COMMON[command]:
        add_fields(common, owners[name], seen, only={name})
    return page.format_help()
