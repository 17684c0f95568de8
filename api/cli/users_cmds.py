"""``raytron users add|list|token|revoke|remove`` and ``raytron audit``: a team's users, as an admin.

They call ``raytron serve`` (``/api/v1/users``, ``/api/v1/audit``) with the caller's token
(RAYTRON_API_TOKEN, else the data dir's bootstrap token), which must be an admin's. A new token is
printed once (``users add``, ``users token``); the server keeps only its digest.
"""

from __future__ import annotations

import datetime

from api.cli.client_cmds import _common, one_call


def add_parsers(sub) -> None:
    p = sub.add_parser("users", help="manage the server's users and their tokens (admin)",
                       description="Add, list and remove users of `raytron serve`, issue and revoke their tokens. "
                                   "Needs an admin's token.")
    users = p.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    a = users.add_parser("add", help="add a user and print its first token (shown once)")
    a.add_argument("name", help="lower-case letters, digits, _ . - (at most 64)")
    a.add_argument("--admin", action="store_true", help="may manage users, read the audit trail, see every job")
    a.add_argument("--gpu-quota", type=int, default=None, metavar="N",
                   help="GPU slots the user's running jobs may hold together (default: no quota)")
    a.add_argument("--max-priority", type=int, default=None, metavar="N",
                   help="the highest priority the user may give a job (default: the server's --max-user-priority)")
    _common(a)
    a.set_defaults(func=cmd_users_add)
    ls = users.add_parser("list", help="list the users")
    _common(ls)
    ls.set_defaults(func=cmd_users_list)
    for action, fn, text in (("token", cmd_users_token, "issue one more token for the user (its others keep "
                                                        "working); printed once"),
                             ("revoke", cmd_users_revoke, "revoke every token of the user, at once"),
                             ("remove", cmd_users_remove, "remove the user and its tokens (its jobs stay)")):
        q = users.add_parser(action, help=text)
        q.add_argument("name", help="the user")
        _common(q)
        q.set_defaults(func=fn)
    p = sub.add_parser("audit", help="the audit trail (admin)", description="Who submitted, cancelled or changed "
                       "what and when, refused attempts included, newest first. Needs an admin's token.")
    p.add_argument("--user", default=None, help="only this user's entries")
    p.add_argument("--action", default=None, help="only this action (submit, cancel, auth, users.add, ...)")
    p.add_argument("--limit", type=int, default=100, help="at most this many entries (default 100, at most 1000)")
    _common(p)
    p.set_defaults(func=cmd_audit)


def _users_table(users: list[dict]) -> str:
    lines = [f"{'USER':<24}{'ADMIN':<7}{'GPU QUOTA':>10}{'MAX PRIO':>10}{'TOKENS':>8}"]
    for u in users:
        quota = "-" if u["gpu_quota"] is None else u["gpu_quota"]
        prio = "-" if u["max_priority"] is None else u["max_priority"]
        lines.append(f"{u['name']:<24}{'yes' if u['admin'] else 'no':<7}{quota:>10}{prio:>10}{u['tokens']:>8}")
    return "\n".join(lines)


def _audit_table(entries: list[dict]) -> str:
    lines = [f"{'TIME (UTC)':<21}{'USER':<16}{'ACTION':<14}{'STATUS':>7}  TARGET"]
    for e in entries:
        when = datetime.datetime.fromtimestamp(e["time"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{when:<21}{e['user'] or '-':<16}{e['action']:<14}{e['status']:>7}  {e['target'] or ''}")
    return "\n".join(lines)


def _remove(client, args) -> dict:
    client.remove_user(args.name)
    return {"name": args.name, "removed": True}


cmd_users_add = one_call(
    "users add", lambda client, args: client.add_user(args.name, admin=args.admin, gpu_quota=args.gpu_quota,
                                                      max_priority=args.max_priority),
    lambda created: f"user {created['name']} added; its token (shown once):\n{created['token']}")
cmd_users_list = one_call("users list", lambda client, args: client.users(), _users_table)
cmd_users_token = one_call("users token", lambda client, args: client.new_token(args.name),
                           lambda issued: f"a new token of {issued['name']} (shown once):\n{issued['token']}")
cmd_users_revoke = one_call("users revoke", lambda client, args: client.revoke(args.name),
                            lambda revoked: f"{revoked['revoked']} token(s) of {revoked['name']} revoked")
cmd_users_remove = one_call("users remove", _remove, lambda removed: f"user {removed['name']} removed")
cmd_audit = one_call("audit", lambda client, args: client.audit(limit=args.limit, user=args.user,
                                                                action=args.action)["entries"], _audit_table)
