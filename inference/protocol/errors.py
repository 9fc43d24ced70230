"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""


class ApiError(Exception):
    def __init__(self, status, message, type="invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  # Retry-After, say

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message, param=None, code=None):
    return ApiError(400, message, param=param, code=code)


def server_error(message="The server failed to answer the request."):
    return ApiError(500, message, type="server_error")


def forbidden(scope):
    return ApiError(403, f"This API key does not have the `{scope}` scope.", code="insufficient_scope")


def unauthorized():
    return ApiError(401, "Missing or invalid API key: send `Authorization: Bearer KEY`.", code="invalid_api_key")


def too_large(limit):
    return ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def not_found(message, code=None, param=None):
    return ApiError(404, message, param=param, code=code)


def too_many(message, retry_after, type, code):
    return ApiError(429, message, type=type, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})
