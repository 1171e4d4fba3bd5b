"""obstore's errors as one-line :class:`BackendError` messages that say what the server said.

- :func:`backend_error`: the HTTP status and S3 error code first, then the request (method and
  URL, without its query) and the reason; the full error stays the cause (``raise … from e``).
"""

from __future__ import annotations

import re

from asynccache.errors import BackendError

__all__ = ["backend_error"]

#: the parts of an obstore error's text that say what failed (see backend_error)
_REQUEST_RE = re.compile(r"Error performing ([A-Z]+) (\S+)")
_STATUS_RE = re.compile(r"status code: ([0-9]{3}(?: [A-Za-z][A-Za-z -]*[A-Za-z])?)")
_CODE_RE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,300})</Message>")
_OS_MESSAGE_RE = re.compile(r'kind: [A-Za-z]+,\s*message: "([^"]{1,100})"')


def backend_error(error: BaseException) -> BackendError:
    """``error`` (obstore's) as one line that leads with what the server said: the HTTP status
    and the S3 error code when it answered, then the request and the reason, e.g.
    ``403 Forbidden SignatureDoesNotMatch (PermissionDeniedError): PUT http://host/bucket/name:
    The request signature we calculated does not match…``. The reply body beyond its ``Code`` and
    ``Message`` is left out, and so is the URL's query: none of our requests carries credentials
    there, but a presigned one would. Raise it ``from error``: the full text stays the cause."""
    text = str(error)
    kind = type(error).__name__
    request = _REQUEST_RE.search(text)
    if request is None:  # not an HTTP request's failure (credentials, configuration): its first line
        first = text.strip().splitlines()[0] if text.strip() else ""
        return BackendError(f"{kind}: {first.split('<', 1)[0].strip()[:300]}")
    where = f"{request[1]} {request[2].split('?', 1)[0]}"
    status = _STATUS_RE.search(text)
    if status is not None:
        code, message = _CODE_RE.search(text), _MESSAGE_RE.search(text)
        lead = status[1] if code is None else f"{status[1]} {code[1]}"
        reason = "" if message is None else message[1].strip()
    else:  # no reply: obstore's reason after the request, and the OS's when it gives one
        lead = ""
        reason = text.strip().splitlines()[0].rsplit(" - ", 1)[-1].strip()
        os_error = _OS_MESSAGE_RE.search(text)
        if os_error is not None:
            reason = f"{reason} ({os_error[1]})"
    head = f"{lead} ({kind})" if lead else kind
    return BackendError(f"{head}: {where}: {reason[:200]}" if reason else f"{head}: {where}")
