"""``gpulayer project``: make a server's projects, set their quotas, add and
remove their members (needs an admin token)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from msgspec import UNSET, UnsetType

from . import output
from .output import Column
from .root import main

if TYPE_CHECKING:
    from ..projects import ProjectInfo
    from ..transport.http import HttpTransport

PROJECT_COLUMNS = (Column("NAME"), Column("GPUS"), Column("SLOTS"), Column("MEMBERS", 60))
NO_LIMIT = "none"  # what a quota of no limit is typed and shown as


# Generic from click 8.5 on; subscripted, it would fail on the 8.1 we allow.
class _Quota(click.ParamType):  # type: ignore[type-arg]
    """A quota: a whole number from 0 on, or ``none`` (no limit)."""

    name = "N|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..errors import GPUlayerError
        from ..projects import MAX_QUOTA, check_quota

        if value is None or isinstance(value, UnsetType | int):  # a default, or converted
            return value
        text = str(value).strip()
        if text.lower() == NO_LIMIT:
            return None
        try:
            number = int(text)
        except ValueError:
            self.fail(
                f"{value!r} is not a quota: give a whole number from 0 to {MAX_QUOTA}, or none",
                param,
                ctx,
            )
        try:
            return check_quota(param.name if param and param.name else "quota", number)
        except GPUlayerError as exc:
            self.fail(str(exc), param, ctx)


_QUOTA = _Quota()


@main.group()
def project() -> None:
    """Manage projects: the teams that share the server's machines (needs an
    admin token)."""


def _admin_transport(ctx: click.Context) -> HttpTransport:
    from ..transport.http import HttpTransport

    if not ctx.obj["server"]:
        raise click.UsageError("projects belong to a server: --server URL or GPULAYER_SERVER")
    transport = HttpTransport(ctx.obj["server"], token=ctx.obj["token"], ca_file=ctx.obj["ca_file"])
    ctx.call_on_close(transport.close)
    return transport


def _quota(value: int | None) -> str:
    return NO_LIMIT if value is None else str(value)


def _said(info: ProjectInfo) -> str:
    members = ", ".join(info.members) if info.members else "no members"
    return f"project {info.name}: GPUs {_quota(info.gpus)}, slots {_quota(info.slots)}, {members}"


def project_object(info: ProjectInfo) -> dict[str, Any]:
    """A project as ``project list --json`` gives it (docs/json-output.md)."""
    return {
        "schema": output.JSON_SCHEMA,
        "name": info.name,
        "gpus": info.gpus,
        "slots": info.slots,
        "members": list(info.members),
        "created": info.created,
    }


@project.command("create")
@click.argument("name")
@click.option("--gpus", type=_QUOTA, help="The most GPUs its running jobs hold at once.")
@click.option("--slots", type=_QUOTA, help="The most CPU slots its running CPU jobs hold at once.")
@click.pass_context
def project_create(ctx: click.Context, name: str, gpus: int | None, slots: int | None) -> None:
    """Make the project NAME (1 to 40 lower-case letters, digits, - and _),
    with no members; with no quota given, it has no limit."""
    made = _admin_transport(ctx).create_project(name, gpus=gpus, slots=slots)
    click.echo(f"{_said(made)} (created)")


@project.command("list")
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for scripts (see docs/json-output.md)."
)
@click.pass_context
def project_list(ctx: click.Context, as_json: bool) -> None:
    """List the projects, oldest first: quotas and members (first added first)."""
    found = _admin_transport(ctx).list_projects()
    if as_json:
        output.print_json([project_object(p) for p in found])
        return
    output.table(
        PROJECT_COLUMNS,
        [(p.name, _quota(p.gpus), _quota(p.slots), ", ".join(p.members)) for p in found],
    )


@project.command("set")
@click.argument("name")
@click.option("--gpus", type=_QUOTA, default=UNSET, help="A new GPU quota (none: no limit).")
@click.option("--slots", type=_QUOTA, default=UNSET, help="A new CPU-slot quota (none: no limit).")
@click.pass_context
def project_set(
    ctx: click.Context, name: str, gpus: int | UnsetType | None, slots: int | UnsetType | None
) -> None:
    """Change the quotas of NAME; one not given stays. It takes effect at the
    next placement: a running job is never stopped for it."""
    if gpus is UNSET and slots is UNSET:
        raise click.UsageError("give --gpus N, --slots N or both (none: no limit)")
    changed = _admin_transport(ctx).set_project_quota(name, gpus=gpus, slots=slots)
    click.echo(_said(changed))


@project.command("add-user")
@click.argument("name")
@click.argument("user")
@click.pass_context
def project_add_user(ctx: click.Context, name: str, user: str) -> None:
    """Make USER a member of NAME: USER sees and manages its members' jobs
    there, and may submit into it."""
    click.echo(_said(_admin_transport(ctx).add_project_member(name, user)))


@project.command("remove-user")
@click.argument("name")
@click.argument("user")
@click.pass_context
def project_remove_user(ctx: click.Context, name: str, user: str) -> None:
    """Take USER out of NAME. USER's jobs there stay in it."""
    click.echo(_said(_admin_transport(ctx).remove_project_member(name, user)))


@project.command("delete")
@click.argument("name")
@click.pass_context
def project_delete(ctx: click.Context, name: str) -> None:
    """Delete NAME; refused while a job in it is queued or running."""
    _admin_transport(ctx).delete_project(name)
    click.echo(f"project {name} deleted")
