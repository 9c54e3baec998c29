// The ack floor: the highest seq at and below which every event is held.

import assert from "node:assert/strict";
import { test } from "node:test";

import { MemoryStore, type EventFrame } from "../src/index.js";

const withheld = (seq: number): EventFrame => ({ kind: "event.withheld", seq, body: {} });

test("the floor stops below a gap and moves on when the gap is filled", async () => {
  const store = new MemoryStore();
  await store.putEvent(withheld(1));
  await store.putEvent(withheld(3));
  assert.equal(await store.ackFloor(), 1);
  await store.putEvent(withheld(2));
  assert.equal(await store.ackFloor(), 3);
});

test("a floor raised by runtime.state skips what was pruned", async () => {
  const store = new MemoryStore();
  await store.putEvent(withheld(7));
  await store.raiseFloor(5);
  assert.equal(await store.ackFloor(), 5);
  await store.putEvent(withheld(6));
  assert.equal(await store.ackFloor(), 7);
});

test("generations only go up, and a journal reset starts again at 0", async () => {
  const store = new MemoryStore({ clock: () => 0 });
  assert.deepEqual([await store.nextGeneration(), await store.nextGeneration()], [1, 2]);
  await store.putEvent(withheld(1));
  await store.resetJournal();
  assert.equal(await store.ackFloor(), 0);
  assert.equal(store.archived[0]?.size, 1);
  assert.equal(await store.nextGeneration(), 3);
});

test("generations come from the clock: a new store starts above an earlier one's", async () => {
  let now = 1_700_000_000_000;
  const clock = (): number => now;
  const earlier = new MemoryStore({ clock });
  // Several attempts within one millisecond still go up by one each.
  const used = [await earlier.nextGeneration(), await earlier.nextGeneration(), await earlier.nextGeneration()];
  assert.deepEqual(used, [now, now + 1, now + 2]);
  // The control plane restarts with a new, empty store (its last generation lost): the clock
  // has moved on, and its first generation is above every one the earlier store used.
  const start = now;
  now += 50;
  const restarted = new MemoryStore({ clock });
  const first = await restarted.nextGeneration();
  assert.ok(first > Math.max(...used), `${first} > ${used}`);
  // A clock that goes back does not take the generation down.
  now -= 1000;
  assert.equal(await restarted.nextGeneration(), start + 51);
});
