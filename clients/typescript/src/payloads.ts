// The payload shapes of each channel, as the contract and docs/ describe them. Types only:
// the rules are checked by PostgreSQL at enqueue (InvalidMessageError) and by the worker.

/** Any JSON value. */
export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/** Extra request headers: names to values. */
export type Headers = Record<string, string>;

/** `webhook`: a POST (or PUT, PATCH) of `body` to `url`, signed and keyed by the worker. */
export interface WebhookPayload {
  /** `http` or `https`; loopback and private addresses are refused unless the daemon allows them. */
  url: string;
  /** Default `POST`. */
  method?: 'POST' | 'PUT' | 'PATCH';
  headers?: Headers;
  /** Sent as `application/json`, byte-identical on every attempt. */
  body?: JsonValue;
  /** Signs with `OUTBOXD_WEBHOOK_SECRET_<NAME>` instead of the default secrets. */
  secret?: string;
  /** Keep the delivering response's body in `response.body`. */
  store_response?: boolean;
  /** After an ambiguous attempt, `GET url` first: 2xx means it took effect. */
  reconcile?: { url: string; found?: string };
}

/** `email`: one message through the daemon's SMTP relay. At least one of `text` and `html`. */
export interface EmailPayload {
  /** One address, bare or `Name <addr>`. */
  from: string;
  to: string | string[];
  cc?: string[];
  bcc?: string[];
  reply_to?: string;
  subject?: string;
  text?: string;
  html?: string;
  headers?: Headers;
}

/** A lookup of an `http` message's effect at its provider, after an ambiguous attempt. */
export interface HttpReconcile {
  method?: 'GET';
  /** Starts with `/`; `{key}` is replaced by the message key. */
  path: string;
  query?: Record<string, string>;
  /** A JSON pointer: a 2xx answer counts as "it took effect" only when it names a value. */
  found?: string;
}

interface HttpPayloadBase {
  /** A row of `outbox.endpoints`: the provider's base URL and the name of its credentials. */
  endpoint: string;
  /** Default `POST`. */
  method?: 'POST' | 'PUT' | 'PATCH' | 'DELETE';
  /** Starts with `/`; appended to the endpoint's URL, never leaving its host. */
  path: string;
  query?: Record<string, JsonValue>;
  headers?: Headers;
  reconcile?: HttpReconcile;
  /** Default `true` on `http`. */
  store_response?: boolean;
}

/**
 * `http`: a call to a provider's API through a named endpoint, whose credentials the daemon
 * holds. A body is `form` (`application/x-www-form-urlencoded`, Stripe's bracket notation) or
 * `json`, not both.
 */
export type HttpPayload = HttpPayloadBase &
  (
    | { form: Record<string, JsonValue>; json?: never }
    | { json: JsonValue; form?: never }
    | { form?: never; json?: never }
  );

/** The payload of each channel. */
export interface Payloads {
  webhook: WebhookPayload;
  email: EmailPayload;
  http: HttpPayload;
}

/** A channel of the outbox. */
export type Channel = keyof Payloads;
