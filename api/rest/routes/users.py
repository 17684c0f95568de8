"""``/api/v1/users`` and ``/api/v1/audit`` (admins only), ``/api/v1/me`` (anyone with a token).

A user's token is shown once, in the answer that creates it (``POST /users``, ``POST
/users/{name}/tokens``); the store keeps only its HMAC digest (:mod:`service.server.accounts`).
Every change here is recorded in the audit trail with the admin who made it.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.rest.deps import AccountsDep, UserDep, require_admin
from api.rest.errors import status_of
from api.rest.schemas import AuditPage, ErrorBody, Me, Revoked, TokenIssued, UserIn, UserList

router = APIRouter(tags=["users"])
admin_router = APIRouter(tags=["users"], dependencies=[Depends(require_admin)])
_ERRORS = {401: {"model": ErrorBody}, 403: {"model": ErrorBody}}
_NAME = Path(description="the user's name (any other string: 404)")


async def _audited(accounts, who: str, action: str, target: str, call, /, *args, **kw):
    """``call(*args, **kw)`` in a worker thread, recorded in the audit trail however it ends."""
    try:
        result = await run_in_threadpool(call, *args, **kw)
    except Exception as e:
        await run_in_threadpool(accounts.record, who, action, target, status_of(e), message=str(e)[:500])
        raise
    return result


@router.get("/me", response_model=Me)
def me(user: UserDep) -> dict:
    """Who the token belongs to: name, admin or not, GPU quota and priority cap."""
    return user.public()


@admin_router.post("/users", status_code=201, response_model=TokenIssued, responses={**_ERRORS, 409: {"model": ErrorBody}})
async def add_user(body: UserIn, user: UserDep, accounts: AccountsDep) -> dict:
    """Create a user and its first token (shown once)."""
    created, token = await _audited(accounts, user.name, "users.add", body.name, accounts.add_user, body.name,
                                    admin=body.admin, gpu_quota=body.gpu_quota, max_priority=body.max_priority)
    await run_in_threadpool(accounts.record, user.name, "users.add", body.name, 201, **created.public())
    return {"name": created.name, "token": token}


@admin_router.get("/users", response_model=UserList, responses=_ERRORS)
def list_users(accounts: AccountsDep) -> dict:
    """Every user, with its quota, priority cap and number of live tokens (never a token)."""
    return {"users": accounts.list_users()}


@admin_router.post("/users/{name}/tokens", status_code=201, response_model=TokenIssued,
                   responses={**_ERRORS, 404: {"model": ErrorBody}})
async def new_token(user: UserDep, accounts: AccountsDep, name: str = _NAME) -> dict:
    """One more token for the user (shown once); its other tokens keep working."""
    token = await _audited(accounts, user.name, "users.token", name, accounts.new_token, name)
    await run_in_threadpool(accounts.record, user.name, "users.token", name, 201)
    return {"name": name, "token": token}


@admin_router.post("/users/{name}/revoke", response_model=Revoked, responses={**_ERRORS, 404: {"model": ErrorBody}})
async def revoke(user: UserDep, accounts: AccountsDep, name: str = _NAME) -> dict:
    """Revoke every token of the user: refused from the next request on."""
    n = await _audited(accounts, user.name, "users.revoke", name, accounts.revoke, name)
    await run_in_threadpool(accounts.record, user.name, "users.revoke", name, 200, revoked=n)
    return {"name": name, "revoked": n}


@admin_router.delete("/users/{name}", status_code=204, responses={**_ERRORS, 404: {"model": ErrorBody},
                                                                  409: {"model": ErrorBody}})
async def remove_user(user: UserDep, accounts: AccountsDep, name: str = _NAME) -> Response:
    """Delete the user and its tokens; its jobs stay, with its name as their owner."""
    await _audited(accounts, user.name, "users.remove", name, accounts.remove, name)
    await run_in_threadpool(accounts.record, user.name, "users.remove", name, 204)
    return Response(status_code=204)


@admin_router.get("/audit", response_model=AuditPage, responses=_ERRORS)
def get_audit(accounts: AccountsDep, limit: int = Query(100, ge=1, le=1000),
              cursor: str | None = Query(None, pattern=r"^[0-9]{1,18}$", description="the next_cursor of the "
                                         "previous page"),
              user: str | None = Query(None, max_length=128, description="only entries of this user"),
              action: str | None = Query(None, max_length=64, description="only this action (submit, cancel, "
                                         "auth, users.add, ...)")) -> dict:
    """The audit trail, newest first: who submitted, cancelled or changed what and when, refused
    attempts included (bad tokens, over quota, rate limited, another user's job); never a token."""
    rows = accounts.audit(limit=limit + 1, before=int(cursor) if cursor else None, user=user, action=action)
    page = rows[:limit]
    return {"entries": page, "count": len(page), "next_cursor": str(page[-1]["id"]) if len(rows) > limit else None}
