// What a control plane keeps about its session between connections (docs/protocol.md §4,
// §9): the generation counter, and the events it holds with its ack floor.
//
// The ack floor is "the highest seq below which (and at which) the client holds every
// event": that value, and only that, is safe for both the x-coding-agent-event-ack header
// and events.ack, since the supervisor replays above the header and prunes at or below an
// ack. The highest seq *seen* is not safe: with a gap below it, an ack would prune events
// the client never stored.

import type { EventFrame } from "./protocol.js";

export interface SessionStore {
  /** The generation of the next connection attempt, persisted before it is returned: one
   * counter for every replica of the control plane that serves this session (a shared
   * row updated atomically), so that no two attempts ever use the same generation. */
  nextGeneration(): Promise<number>;
  /** Store one event (by seq; a seq already held is kept as it is). Durable before it
   * resolves: the client acks what this resolved for. */
  putEvent(event: EventFrame): Promise<void>;
  /** The ack floor (see above). */
  ackFloor(): Promise<number>;
  /** The supervisor's runtime.state says events up to `seq` were acked (by this client or
   * another replica sharing the store): they are pruned there, so the floor is at least that. */
  raiseFloor(seq: number): Promise<void>;
  /** The supervisor's journal is not the one the stored events came from (ack_floor_ahead):
   * keep them aside, start again at floor 0. */
  resetJournal(): Promise<void>;
}

export interface MemoryStoreOptions {
  /** Milliseconds since the epoch (default Date.now); `() => 0` counts 1, 2, 3 … */
  clock?: () => number;
}

/**
 * A store in memory: for tests, and as the reference for a durable one.
 *
 * Its generations are clock-derived: the next one is the larger of the last one plus 1 and
 * the clock's milliseconds since the epoch (docs/client-contract.md, "Generations"). A
 * control plane restarted with a new MemoryStore has lost its last generation; counting
 * from 1 again it would be refused `409 stale_generation` (a stop) until it passed the
 * supervisor's fence, which it cannot read. From the clock it starts above every generation
 * its earlier run used, as long as the clock did not go back. Replicas of a control plane
 * share one counter in their shared store instead.
 */
export class MemoryStore implements SessionStore {
  /** The last generation handed out (0: none yet). */
  generation = 0;
  readonly events = new Map<number, EventFrame>();
  /** Previous journals' events, kept after a reset (newest last). */
  readonly archived: Map<number, EventFrame>[] = [];
  private floor = 0;
  private readonly clock: () => number;

  constructor(options: MemoryStoreOptions = {}) {
    this.clock = options.clock ?? Date.now;
  }

  async nextGeneration(): Promise<number> {
    this.generation = Math.max(this.generation + 1, Math.floor(this.clock()));
    return this.generation;
  }

  async putEvent(event: EventFrame): Promise<void> {
    if (event.seq <= this.floor || this.events.has(event.seq)) return;
    this.events.set(event.seq, event);
    this.advance();
  }

  async ackFloor(): Promise<number> {
    return this.floor;
  }

  async raiseFloor(seq: number): Promise<void> {
    if (seq > this.floor) {
      this.floor = seq;
      this.advance();
    }
  }

  async resetJournal(): Promise<void> {
    this.archived.push(new Map(this.events));
    this.events.clear();
    this.floor = 0;
  }

  private advance(): void {
    while (this.events.has(this.floor + 1)) this.floor += 1;
  }
}
