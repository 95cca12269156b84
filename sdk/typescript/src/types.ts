/**
 * The wire types of the idem HTTP API (SPEC §4), generated from `docs/openapi.json`
 * into `./generated/openapi.ts` by `npm run generate`. JSON field names stay as on the wire.
 */
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];

/** A JSON object (params, results). */
export type JsonObject = Record<string, unknown>;

export type Task = Schemas["Task"];
export type TaskState = Schemas["TaskState"];
export type Contract = Schemas["Contract"];
export type Cancellation = Schemas["Cancellation"];
export type CancelStatus = Schemas["CancelStatus"];
export type Delivery = Schemas["Delivery"];
export type Failure = Schemas["Failure"];
export type FailureClass = Schemas["FailureClass"];
export type Meta = Schemas["Meta"];
export type Attempt = Schemas["Attempt"];
export type AttemptKind = Schemas["AttemptKind"];
export type AttemptState = Schemas["AttemptState"];
export type Evidence = Schemas["Evidence"];
export type TaskEvent = Schemas["Event"];
export type SecondEffect = Schemas["SecondEffect"];
export type EffectAcknowledgment = Schemas["EffectAcknowledgment"];
export type EffectResolution = Schemas["EffectResolution"];
export type EventKind = Schemas["EventKind"];
/**
 * One leased attempt as `POST /v1/attempts/claim` answers it. `traceparent` (W3C trace
 * context of the submit) is sent by servers that record one; `null` or absent otherwise.
 */
export type ClaimedAttempt = Schemas["ClaimedAttempt"] & { traceparent?: string | null };
export type HeartbeatResponse = Schemas["HeartbeatResponse"];
export type ReportBody = Schemas["ReportBody"];
export type Outcome = Schemas["Outcome"];
export type Problem = Schemas["Problem"];
export type ProblemCode = Schemas["ProblemCode"];
export type InvalidValue = Schemas["InvalidValue"];
