/**
 * A message key from durable ids: the parts joined with `:`, each part's `%` written `%25`
 * and its `:` written `%3A`, so that different parts never make the same key.
 * `key('run-1', 'step:2', 'refund') === 'run-1:step%3A2:refund'`.
 *
 * Integers (numbers or bigints) are written in decimal. An empty part, or no part at all,
 * throws a `RangeError`; a part of another type a `TypeError`.
 */
export function key(...parts: (string | number | bigint)[]): string {
  if (parts.length === 0) throw new RangeError('key() needs at least one part');
  return parts
    .map((part, i) => {
      let text: string;
      if (typeof part === 'string') text = part;
      else if (typeof part === 'bigint') text = part.toString();
      else if (typeof part === 'number' && Number.isSafeInteger(part)) text = String(part);
      else throw new TypeError(`key() part ${i} must be a string or an integer`);
      if (text === '') throw new RangeError(`key() part ${i} is empty`);
      return text.replaceAll('%', '%25').replaceAll(':', '%3A');
    })
    .join(':');
}
