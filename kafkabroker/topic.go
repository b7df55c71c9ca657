package kafkabroker

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Provision creates topic with partitions partitions, each on replicas
// brokers, and min.insync.replicas of replicas-1 (at least 1), so that
// acks=all means a record survives a broker lost; a topic that exists is
// left as it is. Run it apart from the services, as a step of its own.
func Provision(ctx context.Context, cl *kgo.Client, topic string, partitions int32, replicas int16) error {
	if !topicName(topic) || partitions < 1 || replicas < 1 {
		return fmt.Errorf("kafkabroker: Provision %q, %d partitions, %d replicas: want a topic's name and at least one of each", topic, partitions, replicas)
	}
	minISR := fmt.Sprint(max(replicas-1, 1))
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

// CheckTopic asks the cluster for topic's metadata: it must exist
// (ErrNoTopic, wrapped, if not), every partition with a leader.
func CheckTopic(ctx context.Context, cl *kgo.Client, topic string) error {
	req := kmsg.NewPtrMetadataRequest()
	t := kmsg.NewMetadataRequestTopic()
	t.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("kafkabroker: topic %s: %w", topic, err)
	}
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
		}
	}
	return nil
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
