package kafkabroker

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Provision creates topic with partitions partitions, each on replicas
// brokers, and the min.insync.replicas that [CheckTopic] asks for: one
// below replicas, and at least 2 (at most replicas), so that acks=all
// means a record is on two brokers at least and survives one lost (two
// replicas then take no write while one is down; a single broker's topic,
// replicas 1, has 1). A topic that exists is left as it is. Run it apart
// from the services, as a step of its own.
func Provision(ctx context.Context, cl *kgo.Client, topic string, partitions int32, replicas int16) error {
	if !topicName(topic) || partitions < 1 || replicas < 1 {
		return fmt.Errorf("kafkabroker: Provision %q, %d partitions, %d replicas: want a topic's name and at least one of each", topic, partitions, replicas)
	}
	minISR := fmt.Sprint(minInSync(replicas))
	req := kmsg.NewPtrCreateTopicsRequest()
	t := kmsg.NewCreateTopicsRequestTopic()
	t.Topic, t.NumPartitions, t.ReplicationFactor = topic, partitions, replicas
	c := kmsg.NewCreateTopicsRequestTopicConfig()
	c.Name, c.Value = "min.insync.replicas", &minISR
	t.Configs = append(t.Configs, c)
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("kafkabroker: create topic %s: %w", topic, err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("kafkabroker: create topic %s: %w", topic, err)
		}
	}
	return nil
}

// ErrNoTopic is returned, wrapped, by [CheckTopic] for a topic the
// cluster does not have.
var ErrNoTopic = errors.New("kafkabroker: no such topic: provision it first")

// ErrTopicUnsafe is returned, wrapped, by [CheckTopic] for a topic on
// which "every in-sync replica has it" does not keep a record through a
// broker lost, or on which no write can succeed.
var ErrTopicUnsafe = errors.New("kafkabroker: the topic cannot keep what it acknowledges")

// minInSync is the min.insync.replicas of a topic of replicas replicas:
// one below, at least 2, at most replicas.
func minInSync(replicas int16) int16 { return min(replicas, max(2, replicas-1)) }

// CheckTopic asks the cluster for topic's metadata and its
// min.insync.replicas: it must exist (ErrNoTopic, wrapped, if not), every
// partition with a leader, and acks=all must mean what the Publisher
// promises (ErrTopicUnsafe, wrapped, if not): on a topic of more than one
// replica, min.insync.replicas at least 2, or the leader alone may
// acknowledge a record and lose it with itself; and never above the
// partitions' replicas, or no write succeeds. A topic of one replica (a
// single broker's) passes: it keeps what its broker keeps.
func CheckTopic(ctx context.Context, cl *kgo.Client, topic string) error {
	req := kmsg.NewPtrMetadataRequest()
	t := kmsg.NewMetadataRequestTopic()
	t.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("kafkabroker: topic %s: %w", topic, err)
	}
	replicas := -1 // the fewest of a partition
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); errors.Is(err, kerr.UnknownTopicOrPartition) {
			return fmt.Errorf("topic %s: %w: %w", topic, ErrNoTopic, err)
		} else if err != nil {
			return fmt.Errorf("kafkabroker: topic %s: %w", topic, err)
		}
		for _, p := range rt.Partitions {
			if p.Leader < 0 {
				return fmt.Errorf("kafkabroker: topic %s partition %d has no leader", topic, p.Partition)
			}
			if replicas < 0 || len(p.Replicas) < replicas {
				replicas = len(p.Replicas)
			}
		}
	}
	minISR, err := topicConfig(ctx, cl, topic, "min.insync.replicas")
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(minISR)
	switch {
	case err != nil:
		return fmt.Errorf("kafkabroker: topic %s: min.insync.replicas %q: %w", topic, minISR, err)
	case replicas > 1 && n < 2:
		return fmt.Errorf("topic %s: %w: min.insync.replicas %d with %d replicas: the leader alone may acknowledge a record, and lose it with itself (want 2 or more)",
			topic, ErrTopicUnsafe, n, replicas)
	case replicas > 0 && n > replicas:
		return fmt.Errorf("topic %s: %w: min.insync.replicas %d above its %d replicas: no write can succeed", topic, ErrTopicUnsafe, n, replicas)
	}
	return nil
}

// topicConfig is the value of topic's config name, as the cluster has it.
func topicConfig(ctx context.Context, cl *kgo.Client, topic, name string) (string, error) {
	req := kmsg.NewPtrDescribeConfigsRequest()
	r := kmsg.NewDescribeConfigsRequestResource()
	r.ResourceType, r.ResourceName, r.ConfigNames = kmsg.ConfigResourceTypeTopic, topic, []string{name}
	req.Resources = append(req.Resources, r)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return "", fmt.Errorf("kafkabroker: topic %s's %s: %w", topic, name, err)
	}
	for _, rr := range resp.Resources {
		if err := kerr.ErrorForCode(rr.ErrorCode); err != nil {
			return "", fmt.Errorf("kafkabroker: topic %s's %s: %w", topic, name, err)
		}
		for _, c := range rr.Configs {
			if c.Name == name && c.Value != nil {
				return *c.Value, nil
			}
		}
	}
	return "", fmt.Errorf("kafkabroker: topic %s: the cluster did not say its %s", topic, name)
}

// Offsets are a topic's offsets, partition by partition: where its records
// start and end (the next offset to be written), and, for a group, its
// committed offset (-1 for a partition it has committed none in).
type Offsets struct {
	Start, End, Committed map[int32]int64
}

// Stored is how many records the topic holds: the sum of End - Start.
func (o Offsets) Stored() int64 {
	var n int64
	for p, end := range o.End {
		n += end - o.Start[p]
	}
	return n
}

// Lag is how many records the group has not yet committed past: the sum
// of End minus Committed (or Start, for a partition with none committed).
func (o Offsets) Lag() int64 {
	var n int64
	for p, end := range o.End {
		from := o.Committed[p]
		if from < o.Start[p] {
			from = o.Start[p]
		}
		n += max(end-from, 0)
	}
	return n
}

// TopicOffsets asks the cluster for topic's offsets, and, if group is not
// "", the group's committed offsets in it.
func TopicOffsets(ctx context.Context, cl *kgo.Client, topic, group string) (Offsets, error) {
	o := Offsets{Start: map[int32]int64{}, End: map[int32]int64{}, Committed: map[int32]int64{}}
	meta := kmsg.NewPtrMetadataRequest()
	mt := kmsg.NewMetadataRequestTopic()
	mt.Topic = kmsg.StringPtr(topic)
	meta.Topics = append(meta.Topics, mt)
	mresp, err := meta.RequestWith(ctx, cl)
	if err != nil {
		return o, fmt.Errorf("kafkabroker: topic %s: %w", topic, err)
	}
	var partitions []int32
	for _, rt := range mresp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil {
			return o, fmt.Errorf("kafkabroker: topic %s: %w", topic, err)
		}
		for _, p := range rt.Partitions {
			partitions = append(partitions, p.Partition)
		}
	}
	for _, at := range []struct {
		ts  int64
		dst map[int32]int64
	}{{-2, o.Start}, {-1, o.End}} { // -2 the earliest offset, -1 the latest
		req := kmsg.NewPtrListOffsetsRequest()
		rt := kmsg.NewListOffsetsRequestTopic()
		rt.Topic = topic
		for _, p := range partitions {
			rp := kmsg.NewListOffsetsRequestTopicPartition()
			rp.Partition, rp.Timestamp = p, at.ts
			rt.Partitions = append(rt.Partitions, rp)
		}
		req.Topics = append(req.Topics, rt)
		shards := cl.RequestSharded(ctx, req)
		for _, sh := range shards {
			if sh.Err != nil {
				return o, fmt.Errorf("kafkabroker: offsets of %s: %w", topic, sh.Err)
			}
			for _, t := range sh.Resp.(*kmsg.ListOffsetsResponse).Topics {
				for _, p := range t.Partitions {
					if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
						return o, fmt.Errorf("kafkabroker: offsets of %s partition %d: %w", topic, p.Partition, err)
					}
					at.dst[p.Partition] = p.Offset
				}
			}
		}
	}
	if group == "" {
		return o, nil
	}
	req := kmsg.NewPtrOffsetFetchRequest()
	req.Group = group
	rt := kmsg.NewOffsetFetchRequestTopic()
	rt.Topic, rt.Partitions = topic, partitions
	req.Topics = append(req.Topics, rt)
	for _, p := range partitions {
		o.Committed[p] = -1
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return o, fmt.Errorf("kafkabroker: group %s's offsets: %w", group, err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); errors.Is(err, kerr.GroupIDNotFound) {
		return o, nil // a group not yet joined: nothing committed
	} else if err != nil {
		return o, fmt.Errorf("kafkabroker: group %s's offsets: %w", group, err)
	}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return o, fmt.Errorf("kafkabroker: group %s's offset in %s partition %d: %w", group, topic, p.Partition, err)
			}
			o.Committed[p.Partition] = p.Offset
		}
	}
	return o, nil
}
