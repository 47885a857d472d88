"""The control API as an OpenAPI 3.1 document (served at /openapi.json; the fuzz tests are driven from it)."""

from __future__ import annotations

from typing import Any

from .._version import __version__
from .security import CONTROL_HEADER
from .wire import JSON_CONTENT_TYPE, REASONS

__all__ = ["openapi_document"]


def openapi_document() -> dict[str, Any]:
    """The control API as OpenAPI 3.1 (served at /openapi.json; the fuzz tests are driven from it)."""
    error = {"$ref": "#/components/schemas/Error"}

    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": REASONS[c], "content": {JSON_CONTENT_TYPE: {"schema": error}}} for c in codes}

    capture_id = {"name": "id", "in": "path", "required": True,
                  "schema": {"type": "string", "pattern": "^[0-9a-f]{22}$"}}
    auth: list[dict[str, list[str]]] = [{"bearer": []}]
    control = {"name": CONTROL_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
               "description": "Required (any value, e.g. 1) when the agent has no token: with no token the control "
                              "routes answer only a loopback peer of an agent bound to loopback that sends it. "
                              "On every control route a Host that does not name the agent (localhost, its "
                              "addresses, allowed_hosts) or an Origin other than the agent's own is refused 403."}
    return {
        "openapi": "3.1.0",
        "info": {"title": "perfmon agent", "version": __version__,
                 "description": "Metrics, stats and the profiler capture API of an in-process perfmon agent."},
        "paths": {
            "/metrics": {"get": {"summary": "Prometheus metrics (text; OpenMetrics or protobuf by Accept)",
                                 "responses": {"200": {"description": "OK", "content": {"text/plain": {}}}}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "OK"},
                                                                       **errors(503)}}},
            "/stats": {"get": {"summary": "Counts, exact percentiles, devices, short time series (JSON)",
                               "responses": {"200": {"description": "OK", "content": {JSON_CONTENT_TYPE: {}}}}}},
            "/profile": {"post": {
                "summary": "Arm a profiler capture of a model's next calls (Content-Type: application/json, "
                           "else 415)", "security": auth, "parameters": [control],
                "requestBody": {"required": False, "content": {JSON_CONTENT_TYPE: {"schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"model": {"type": "string"}, "steps": {"type": "integer", "minimum": 1,
                                                                            "maximum": 100},
                                   "max_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                                   "record_shapes": {"type": "boolean"}, "with_stack": {"type": "boolean"},
                                   "profile_memory": {"type": "boolean"}}}}}},
                "responses": {"202": {"description": "Armed", "content": {JSON_CONTENT_TYPE: {}}},
                              **errors(400, 401, 403, 404, 409, 413, 415, 429)}}},
            "/profiles": {"get": {"summary": "Captures, newest first", "security": auth, "parameters": [control],
                                  "responses": {"200": {"description": "OK", "content": {JSON_CONTENT_TYPE: {}}},
                                                **errors(401, 403)}}},
            "/profiles/{id}": {"get": {"summary": "A capture's metadata, op summary, per-step op table and "
                                                  "comparison with its model's baseline capture", "security": auth,
                                       "parameters": [capture_id, control],
                                       "responses": {"200": {"description": "OK", "content": {JSON_CONTENT_TYPE: {}}},
                                                     **errors(401, 403, 404)}},
                               "delete": {"summary": "Cancel the capture in flight: an armed one now (outcome "
                                                     "aborted), a recording one at its thread's next call",
                                          "security": auth, "parameters": [capture_id, control],
                                          "responses": {"200": {"description": "Cancelled",
                                                                "content": {JSON_CONTENT_TYPE: {}}},
                                                        "202": {"description": "Ends at the next call",
                                                                "content": {JSON_CONTENT_TYPE: {}}},
                                                        **errors(401, 403, 404, 409)}}},
            "/profiles/{id}/trace": {"get": {
                "summary": "The capture's Chrome trace (gzip; Perfetto, TensorBoard)", "security": auth,
                "parameters": [capture_id, control],
                "responses": {"200": {"description": "OK", "content": {"application/gzip": {}}},
                              **errors(401, 403, 404)}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["error"],
                                  "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}},
        },
    }
