"""The one application error type. Services raise it; the API renders it as
`{"type", "title", "detail", "field_errors"}` with `status`."""

from __future__ import annotations


class ApplicationError(Exception):
    """A refusal a user can act on. `type` is a short slug ("insufficient-resource"), `detail`
    a sentence, `field_errors` maps request fields to messages, `status` the HTTP status."""

    def __init__(
        self,
        detail: str,
        *,
        type: str = "invalid-request",
        title: str = "Invalid request",
        status: int = 400,
        field_errors: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.type = type
        self.title = title
        self.status = status
        self.field_errors = field_errors or {}
